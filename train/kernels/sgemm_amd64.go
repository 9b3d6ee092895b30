package kernels

import "golang.org/x/sys/cpu"

// useKernel says whether the AVX2+FMA micro-kernel of sgemm runs here.
var useKernel = cpu.X86.HasAVX2 && cpu.X86.HasFMA

//go:noescape
func kern6x16(kc int, a *float32, ars, aps int, b *float32, bps int, c *float32, ldc int, acc bool)

//go:noescape
func expShift8(dst, src *float32, n int, shift float32)
