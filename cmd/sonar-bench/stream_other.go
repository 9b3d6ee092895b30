//go:build !amd64

package main

func streamKernel(p, g, m, v []float32) { streamGo(p, g, m, v) }
