package vml

import (
	"os"
	"testing"
)

// BenchmarkApply512 is one call of the size the engine makes (one 512-element
// block): it measures what calling vmsSqrt through purego costs.
func BenchmarkApply512(b *testing.B) {
	s, err := Load(os.Getenv("SONAR_TORCH_LIB"))
	if err != nil {
		b.Skip(err)
	}
	src := make([]float32, 512)
	dst := make([]float32, 512)
	for i := range src {
		src[i] = float32(i) + 0.5
	}
	b.SetBytes(512 * 4)
	for i := 0; i < b.N; i++ {
		s.Apply(dst, src)
	}
}
