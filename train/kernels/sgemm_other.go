//go:build !amd64

package kernels

const useKernel = false

func kern6x16(kc int, a *float32, ars, aps int, b *float32, bps int, c *float32, ldc int, acc bool) {
	panic("kernels: no SGEMM micro-kernel on this architecture")
}

func expShift8(dst, src *float32, n int, shift float32) {
	panic("kernels: no vector exp on this architecture")
}
