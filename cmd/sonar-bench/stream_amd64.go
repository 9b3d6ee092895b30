package main

import "golang.org/x/sys/cpu"

//go:noescape
func streamAVX2(pp, gg, mm, vv *float32, n int)

// streamKernel moves AdamW's bytes (read p, g, m, v; write p, m, v) with
// AVX2 loads and stores where the CPU has them.
func streamKernel(p, g, m, v []float32) {
	n := len(p) &^ 7
	if cpu.X86.HasAVX2 && n > 0 {
		streamAVX2(&p[0], &g[:n][0], &m[:n][0], &v[:n][0], n)
	}
	streamGo(p[n:], g[n:], m[n:], v[n:])
}
