package vml

import (
	"os"
	"testing"
)

// benchApply times one call of the library's vmsSqrt (SONAR_TORCH_LIB) on
// src a call, and reports its cost an element.
func benchApply(b *testing.B, src []float32) {
	s, err := Load(os.Getenv("SONAR_TORCH_LIB"))
	if err != nil {
		b.Skip(err)
	}
	dst := make([]float32, len(src))
	b.SetBytes(int64(4 * len(src)))
	for i := 0; i < b.N; i++ {
		s.Apply(dst, src)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(src)), "ns/elem")
}

// BenchmarkApply512 is one call of the size the engine makes (one 512-element
// block): it measures what calling vmsSqrt through purego costs.
func BenchmarkApply512(b *testing.B) {
	src := make([]float32, 512)
	for i := range src {
		src[i] = float32(i) + 0.5
	}
	benchApply(b, src)
}

// BenchmarkApply4096 is one call of the block the engine's step passes to a
// square root it calls (optimizer.callBlock): per element, the cost of MKL's
// vmsSqrt itself, which bounds the step that calls it.
func BenchmarkApply4096(b *testing.B) {
	src := make([]float32, 4096)
	for i := range src {
		src[i] = 1e-8 * float32(i+1) * float32(i+3) // squared moments: small, positive
	}
	benchApply(b, src)
}
