package optimizer

import (
	"math"
	"math/rand/v2"
	"testing"
)

// The fused kernel's evaluation order, element by element, in three builds:
// the vector loop and the tail of an FMA build, and a build without FMA.
// Bitwise equality with torch itself is tested from Python
// (tests/test_fused_bitwise.py); this checks the Go pieces agree with each
// other where they must and differ where the kernel's contractions differ.
func TestFusedOrders(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const n = 4099 // 4096 in the vector loop with 8 lanes, 3 in the tail
	s := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 3)
	s.Fused = true
	mk := func() ([]float32, []float32, []float32, []float32) {
		p, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range p {
			p[i] = float32(r.NormFloat64() * 0.1)
			g[i] = float32(r.NormFloat64() * math.Exp2(float64(r.IntN(14)-12)))
			m[i] = float32(r.NormFloat64() * 1e-3)
			v[i] = float32(r.Float64() * 1e-5)
		}
		return p, g, m, v
	}
	p0, g, m0, v0 := mk()
	run := func(lanes int) ([]float32, []float32) {
		p, m, v := append([]float32(nil), p0...), append([]float32(nil), m0...), append([]float32(nil), v0...)
		sc := s
		sc.Lanes = lanes
		FusedStepF32(p, g, m, v, nil, sc, 0, n)
		return p, v
	}
	pVec, vVec := run(8)
	pPlain, vPlain := run(0)
	diffV, tailSame := 0, 0
	for i := 0; i < n; i++ {
		if vVec[i] != vPlain[i] {
			diffV++
		}
		// Element by element the vector order is the kernel's for elements before the tail.
		k := fusedOf(Scalars{Decay: s.Decay, ApplyDecay: s.ApplyDecay, Beta1W: s.Beta1W, Beta2: s.Beta2,
			OneMinusB2: s.OneMinusB2, NegStepSize: s.NegStepSize, BC2Sqrt: s.BC2Sqrt, Eps: s.Eps, Lanes: 8})
		pe, _, ve, _ := fusedElement(p0[i], g[i], m0[i], v0[i], 0, k, i >= n-3)
		if pe != pVec[i] || ve != vVec[i] {
			t.Fatalf("element %d: FusedStepF32 and fusedElement disagree", i)
		}
		if i >= n-3 {
			if _, _, vt, _ := fusedElement(p0[i], g[i], m0[i], v0[i], 0, k, false); vt == ve {
				tailSame++
			}
		}
	}
	if diffV == 0 {
		t.Error("the FMA build and the plain build computed the same exp_avg_sq everywhere: the contraction is not applied")
	}
	if math.IsNaN(float64(pPlain[0])) || pVec[0] == p0[0] {
		t.Error("no update")
	}
	t.Logf("exp_avg_sq differs between FMA and plain builds at %d of %d elements; tail elements equal to the vector order: %d of 3", diffV, n, tailSame)
}

func TestFusedTail(t *testing.T) {
	for _, tc := range []struct{ numel, lanes, want int }{{100, 8, 96}, {96, 8, 96}, {5, 16, 0}, {33, 0, 33}, {7, 32, 0}} {
		if got := fusedTail(tc.numel, tc.lanes); got != tc.want {
			t.Errorf("fusedTail(%d, %d) = %d, want %d", tc.numel, tc.lanes, got, tc.want)
		}
	}
}

// BenchmarkFused is one fused step of a 1M-element tensor through the engine
// (2 workers), to compare with torch's fused kernel (bench/ for the table).
func BenchmarkFused(b *testing.B) {
	for _, dt := range []DType{Float32, BFloat16} {
		b.Run(dt.String(), func(b *testing.B) {
			const n = 1 << 20
			// Parameter and gradient at different offsets mod 4 KiB (the
			// state lands at the parameter's: stateOffset).
			param := staggered(n*dt.Size(), 512)
			grad := staggered(n*dt.Size(), 3072)
			r := rand.New(rand.NewPCG(1, 2))
			for i := 0; i < n; i++ {
				pv, gv := float32(r.NormFloat64()*0.1), float32(r.NormFloat64()*1e-2)
				if dt == Float32 {
					F32s(param)[i], F32s(grad)[i] = pv, gv
				} else {
					U16s(param)[i], U16s(grad)[i] = F32ToBF16(pv), F32ToBF16(gv)
				}
			}
			t, err := NewTensor("w", dt, n, Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, param)
			if err != nil {
				b.Fatal(err)
			}
			e := NewEngine()
			e.Workers = 2
			b.SetBytes(int64(n * dt.Size()))
			for i := 0; i < b.N; i++ {
				s := ScalarsFor(t.Hyper, t.Step+1)
				s.Fused, s.Lanes = true, 8
				if err := e.Apply(t, grad, s); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
