package optimizer

import (
	"math/rand/v2"
	"testing"
)

func benchBufs(n int) (p, g, m, v []float32) {
	r := rand.New(rand.NewPCG(1, 2))
	mk := func(off int) []float32 {
		b := f32s(staggered(4*n, off))
		for i := range b {
			b[i] = float32(r.NormFloat64()) * 0.01
		}
		return b
	}
	p, g, m, v = mk(0), mk(512), mk(0), mk(0) // as the engine and sonar_moe place them
	for i := range v {
		v[i] *= v[i]
	}
	return
}

func BenchmarkStepF32(b *testing.B) {
	const n = 1 << 22
	p, g, m, v := benchBufs(n)
	s := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 3)
	b.SetBytes(28 * n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		StepF32(p, g, m, v, nil, s, Sqrt{})
	}
}

func BenchmarkFMA32(b *testing.B) {
	x := float32(0.1)
	for i := 0; i < b.N; i++ {
		x = FMA32(x, 1.0000001, 1e-9)
	}
	_ = x
}

func BenchmarkStepBF16(b *testing.B) {
	const n = 1 << 22
	p32, g32, m32, v32 := benchBufs(n)
	conv := func(x []float32, off int) []uint16 {
		o := u16s(staggered(2*n, off))
		for i := range o {
			o[i] = F32ToBF16(x[i])
		}
		return o
	}
	p, g, m, v := conv(p32, 0), conv(g32, 512), conv(m32, 0), conv(v32, 0)
	s := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 3)
	b.SetBytes(14 * n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		StepBF16(p, g, m, v, nil, s)
	}
}
