package main

import (
	"time"

	"github.com/sonar-moe/sonar/optimizer"
)

//go:noescape
func dividerYMM(n int, x *float32)

//go:noescape
func dividerZMM(n int, x *float32)

// Divider is the floor the core's divider puts under an AdamW kernel that
// runs torch's arithmetic for each element on it: one square root and two
// divisions (the IEEE ones; MKL's emulated root needs none of it). The
// kernels that divide by bias_correction2_sqrt with fused multiply-adds
// instead (optimizer/divide_amd64.h) leave the divider one square root and
// one division. Measured on one core with nothing else in the loop; the
// best of the reps.
type Divider struct {
	YMM float64 `json:"ymm_ns_per_element"`           // 8 lanes (AVX)
	ZMM float64 `json:"zmm_ns_per_element,omitempty"` // 16 lanes, where the CPU has AVX-512
}

func dividerFloor(reps int) *Divider {
	if optimizer.CPUISA() < optimizer.ISAAVX2 {
		return nil
	}
	x := make([]float32, 32)
	for i := range x {
		x[i] = 1.2345 + float32(i)
	}
	const iters = 2_000_000
	best := func(f func(int, *float32), lanes int) float64 {
		b := time.Duration(1 << 62)
		for range max(reps, 3) {
			s := time.Now()
			f(iters, &x[0])
			b = min(b, time.Since(s))
		}
		return float64(b.Nanoseconds()) / float64(iters*2*lanes)
	}
	d := &Divider{YMM: best(dividerYMM, 8)}
	if optimizer.CPUISA() >= optimizer.ISAAVX512 {
		d.ZMM = best(dividerZMM, 16)
	}
	return d
}
