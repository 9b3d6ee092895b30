//go:build !amd64

package hfmoe

const useKernel = false

func kern6x16(kc int, a *float32, ars, aps int, b *float32, bps int, c *float32, ldc int, acc bool) {
	panic("hfmoe: no SGEMM micro-kernel on this architecture")
}

func expShift8(dst, src *float32, n int, shift float32) {
	panic("hfmoe: no vector exp on this architecture")
}
