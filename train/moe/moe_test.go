package moe

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/sonar-moe/sonar/train/internal/gradcheck"
)

// Gradient checks in float64 against central finite differences
// (package gradcheck), and the top-k choice.

func TestTopK(t *testing.T) {
	cases := []struct {
		name string
		p    []float32
		k    int
		want []int32
	}{
		{"top1", []float32{0.1, 0.5, 0.4}, 1, []int32{1}},
		{"top2 descending", []float32{0.1, 0.2, 0.3, 0.4}, 2, []int32{3, 2}},
		{"all", []float32{0.3, 0.1, 0.6}, 3, []int32{2, 0, 1}},
		{"ties keep index order", []float32{0.25, 0.25, 0.25, 0.25}, 3, []int32{0, 1, 2}},
		{"tie at the cut", []float32{0.2, 0.4, 0.2, 0.2}, 2, []int32{1, 0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := make([]int32, c.k)
			TopK(got, c.p)
			if !slices.Equal(got, c.want) {
				t.Errorf("TopK(%v, %d) = %v, want %v", c.p, c.k, got, c.want)
			}
		})
	}
}

func TestRouterGrad(t *testing.T) {
	for _, tc := range []struct {
		k         int
		norm, aux bool
	}{{1, false, false}, {2, false, true}, {2, true, false}, {3, true, true}} {
		t.Run(fmt.Sprintf("k%d_norm%v_aux%v", tc.k, tc.norm, tc.aux), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, uint64(tc.k)))
			T, h, e := 6, 5, 4
			x, wr := gradcheck.Randn(rng, T*h, 1), gradcheck.Randn(rng, e*h, 1)
			Rw := gradcheck.Randn(rng, T*tc.k, 1)
			var aux []float64
			if tc.aux {
				aux = gradcheck.Randn(rng, e, 1)
			}
			rt := NewRouting[float64](T, e, tc.k, tc.norm)
			dx, dwr := make([]float64, T*h), make([]float64, e*h)
			loss := func() float64 {
				RouterForward(&rt, x, wr, h)
				l := gradcheck.Dot(Rw, rt.W)
				for i, pv := range rt.Probs {
					if aux != nil {
						l += aux[i%e] * pv
					}
				}
				return l
			}
			gradcheck.Check(t, gradcheck.Case{
				Vars: []gradcheck.Var{gradcheck.V("x", x, dx), gradcheck.V("router", wr, dwr)},
				Loss: loss,
				Backward: func() {
					loss()
					clear(dx)
					clear(dwr)
					RouterBackward(dx, dwr, &rt, Rw, aux, x, wr, h)
				},
				Branch: func() string { return fmt.Sprint(rt.Idx) },
			}, rng, 20)
		})
	}
}

func TestExpertsGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	T, h, in, e, k := 7, 6, 5, 4, 2
	x, gu, dn := gradcheck.Randn(rng, T*h, 1), gradcheck.Randn(rng, e*2*in*h, 0.5), gradcheck.Randn(rng, e*h*in, 0.5)
	R := gradcheck.Randn(rng, T*h, 1)
	rt := NewRouting[float64](T, e, k, true)
	// Fixed routing that leaves expert 3 idle; weights are inputs too.
	for t := range T {
		rt.Idx[t*k], rt.Idx[t*k+1] = int32(t%3), int32((t+1)%3)
	}
	w := gradcheck.Randn(rng, T*k, 1)
	d := NewDispatch[float64](T, h, in, e, k)
	s := NewExpertScratch[float64](T, h, in, k)
	out := make([]float64, T*h)
	dx, dw, dgu, ddn := make([]float64, T*h), make([]float64, T*k), make([]float64, len(gu)), make([]float64, len(dn))
	loss := func() float64 {
		copy(rt.W, w)
		ExpertsForward(out, x, &rt, &d, gu, dn, h, in)
		return gradcheck.Dot(R, out)
	}
	gradcheck.Check(t, gradcheck.Case{
		Vars: []gradcheck.Var{gradcheck.V("x", x, dx), gradcheck.V("w", w, dw), gradcheck.V("gate_up", gu, dgu), gradcheck.V("down", dn, ddn)},
		Loss: loss,
		Backward: func() {
			loss()
			clear(dx)
			for i := range ddn {
				ddn[i] = 7 // must be overwritten
			}
			ExpertsBackward(dx, dw, dgu, ddn, &s, R, &rt, &d, gu, dn, h, in)
		},
	}, rng, 30)
	idle := 3
	for i := idle * 2 * in * h; i < (idle+1)*2*in*h; i++ {
		if dgu[i] != 0 {
			t.Fatalf("idle expert's gate_up gradient %v at %d: want 0", dgu[i], i)
		}
	}
}
