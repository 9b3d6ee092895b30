//go:build !amd64

package hfmoe

const useKernel = false

func kern6x16(kc int, a, b, c *float32) { panic("hfmoe: no SGEMM micro-kernel on this architecture") }
