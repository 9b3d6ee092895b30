package main

import (
	"time"

	"github.com/sonar-moe/sonar/optimizer"
)

// Stream is the machine's streaming bandwidth for AdamW's access pattern:
// four arrays read and three written in one pass, split over the workers as
// the engine splits a tensor, with (almost) no arithmetic. It is the limit a
// memory-bound AdamW kernel can reach on this machine; a plain copy (one
// read and one write stream per core) understates it.
type Stream struct {
	Elements int       `json:"elements"` // float32 elements per array
	Workers  int       `json:"workers"`
	MedianS  float64   `json:"median_s"`
	TimesS   []float64 `json:"times_s"`
	GBps     float64   `json:"gb_per_s"` // 28 bytes per element
}

func streamGo(p, g, m, v []float32) {
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)]
	for i := range p {
		p[i] += g[i]
		m[i] += g[i]
		v[i] += g[i]
	}
}

// streamBandwidth measures Stream over arrays of n float32 elements placed
// as the engine's buffers are: p, m and v at one offset mod 4 KiB (the
// engine puts the state at the parameter's), g 512 bytes after it (where
// sonar_moe's gradient ring puts it).
func streamBandwidth(n, workers, reps int) Stream {
	arr := func(off int) []float32 {
		f := optimizer.F32s(staggered(4*n, off))
		for i := range f {
			f[i] = float32(i&1023) * 1e-9
		}
		return f
	}
	p, g, m, v := arr(0), arr(512), arr(0), arr(0)
	run := func() float64 {
		t := time.Now()
		parallel(n, workers, func(lo, hi int) { streamKernel(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]) })
		return time.Since(t).Seconds()
	}
	run()
	s := Stream{Elements: n, Workers: workers}
	for range reps {
		s.TimesS = append(s.TimesS, run())
	}
	s.MedianS = median(s.TimesS)
	s.GBps = 28 * float64(n) / s.MedianS / 1e9
	return s
}
