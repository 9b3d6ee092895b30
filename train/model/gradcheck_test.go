package model

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/sonar-moe/sonar/train/kernels"
	"github.com/sonar-moe/sonar/train/moe"
)

// Gradient checks: every layer's backward against central finite
// differences of its forward, on a few random coordinates of every input.
// Layers whose output is a tensor are reduced to a scalar with a fixed random
// projection, L = sum(R * out), computed in float64; the check perturbs
// float32 values, so tolerances allow for float32 rounding.

// gvar is one checked input: its values and the analytic gradient.
type gvar struct {
	name string
	x    []float32
	grad []float32
}

// gcase is a layer wired for checking.
type gcase struct {
	vars     []gvar
	loss     func() float64 // forward and reduction at the current values
	backward func()         // analytic gradients of loss into vars[i].grad
	// branch, when set, fingerprints the piecewise-constant choices (top-k
	// experts); coordinates whose perturbation changes it are skipped.
	branch func() string
}

func randn(rng *rand.Rand, n int, std float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * std)
	}
	return x
}

func randTokens(rng *rand.Rand, n, v int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(rng.IntN(v))
	}
	return t
}

// project returns sum(r*out) in float64.
func project(r, out []float32) float64 {
	var s float64
	for i := range r {
		s += float64(r[i]) * float64(out[i])
	}
	return s
}

func checkGrad(t *testing.T, c gcase, rng *rand.Rand, coords int) {
	t.Helper()
	c.loss()
	for _, v := range c.vars {
		clear(v.grad)
	}
	c.backward()
	base := ""
	if c.branch != nil {
		base = c.branch()
	}
	for _, v := range c.vars {
		checked := 0
		for try := 0; checked < coords && try < 20*coords; try++ {
			i := rng.IntN(len(v.x))
			orig := v.x[i]
			step := float32(1e-2) * max(1, float32(math.Abs(float64(orig))))
			v.x[i] = orig + step
			lp := c.loss()
			okp := c.branch == nil || c.branch() == base
			v.x[i] = orig - step
			lm := c.loss()
			okm := c.branch == nil || c.branch() == base
			v.x[i] = orig
			if !okp || !okm {
				continue // the top-k choice moved: not differentiable here
			}
			fd := (lp - lm) / float64(2*step)
			an := float64(v.grad[i])
			if tol := 2e-3 + 2e-2*max(math.Abs(fd), math.Abs(an)); math.Abs(fd-an) > tol {
				t.Errorf("%s[%d]: analytic %.6g, finite difference %.6g (tolerance %.2g)", v.name, i, an, fd, tol)
			}
			checked++
		}
		if checked < coords {
			t.Errorf("%s: only %d of %d coordinates checkable", v.name, checked, coords)
		}
	}
	c.loss() // leave the forward state at the unperturbed values
}

func TestGradients(t *testing.T) {
	cases := []struct {
		name  string
		build func(t *testing.T, rng *rand.Rand) gcase
	}{
		{"embedding", func(t *testing.T, rng *rand.Rand) gcase { return embedCase(rng, 7, 5, 9) }},
		{"rmsnorm", func(t *testing.T, rng *rand.Rand) gcase { return normCase(rng, 6, 11) }},
		{"rmsnorm/wide", func(t *testing.T, rng *rand.Rand) gcase { return normCase(rng, 3, 64) }},
		{"mix/window3", func(t *testing.T, rng *rand.Rand) gcase { return mixCase(rng, 2, 5, 6, 3) }},
		{"mix/window-longer-than-seq", func(t *testing.T, rng *rand.Rand) gcase { return mixCase(rng, 3, 2, 4, 4) }},
		{"router/top2of4", func(t *testing.T, rng *rand.Rand) gcase { return routerCase(rng, 9, 6, 4, 2) }},
		{"router/top1of3", func(t *testing.T, rng *rand.Rand) gcase { return routerCase(rng, 9, 5, 3, 1) }},
		{"router/top3of5", func(t *testing.T, rng *rand.Rand) gcase { return routerCase(rng, 7, 6, 5, 3) }},
		{"experts/top2of4", func(t *testing.T, rng *rand.Rand) gcase { return expertsCase(rng, 10, 6, 5, 4, 2) }},
		{"experts/top1of3-idle", func(t *testing.T, rng *rand.Rand) gcase { return expertsCase(rng, 4, 5, 3, 3, 1) }},
		{"head", func(t *testing.T, rng *rand.Rand) gcase { return headCase(rng, 6, 5, 13) }},
		{"loss", func(t *testing.T, rng *rand.Rand) gcase { return lossCase(rng, 5, 11) }},
		{"model/1layer", func(t *testing.T, rng *rand.Rand) gcase { return modelCase(t, rng, 1, 2, 5) }},
		{"model/2layers", func(t *testing.T, rng *rand.Rand) gcase { return modelCase(t, rng, 2, 3, 4) }},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(i), 42))
			checkGrad(t, tc.build(t, rng), rng, 6)
		})
	}
}

func embedCase(rng *rand.Rand, tokens, h, v int) gcase {
	table := randn(rng, v*h, 1)
	tok := randTokens(rng, tokens, v)
	tok[1] = tok[0] // a repeated token accumulates
	r := randn(rng, tokens*h, 1)
	out := make([]float32, tokens*h)
	g := make([]float32, v*h)
	return gcase{
		vars:     []gvar{{"table", table, g}},
		loss:     func() float64 { embedForward(out, table, tok, h); return project(r, out) },
		backward: func() { embedBackward(g, r, tok, h) },
	}
}

func normCase(rng *rand.Rand, tokens, h int) gcase {
	x, w := randn(rng, tokens*h, 1.5), randn(rng, h, 1)
	r := randn(rng, tokens*h, 1)
	y, scale := make([]float32, tokens*h), make([]float32, tokens)
	dx, dw := make([]float32, tokens*h), make([]float32, h)
	return gcase{
		vars:     []gvar{{"x", x, dx}, {"weight", w, dw}},
		loss:     func() float64 { kernels.RMSNormForward(y, scale, x, w, h, 1e-6); return project(r, y) },
		backward: func() { kernels.RMSNormBackward(dx, dw, r, x, w, scale, h) },
	}
}

func mixCase(rng *rand.Rand, batch, seq, h, k int) gcase {
	rows := batch * seq
	n, c, wo := randn(rng, rows*h, 1), randn(rng, k*h, 1), randn(rng, h*h, 0.5)
	r := randn(rng, rows*h, 1)
	y, u, du := make([]float32, rows*h), make([]float32, rows*h), make([]float32, rows*h)
	dn, dc, dwo := make([]float32, rows*h), make([]float32, k*h), make([]float32, h*h)
	return gcase{
		vars:     []gvar{{"n", n, dn}, {"conv", c, dc}, {"out", wo, dwo}},
		loss:     func() float64 { mixForward(y, u, n, c, wo, batch, seq, h, k); return project(r, y) },
		backward: func() { mixBackward(dn, dc, dwo, du, r, n, u, c, wo, batch, seq, h, k) },
	}
}

func routerCase(rng *rand.Rand, tokens, h, e, k int) gcase {
	x, wr := randn(rng, tokens*h, 1), randn(rng, e*h, 0.7)
	rt := moe.NewRouting[float32](tokens, e, k, true)
	r := randn(rng, tokens*k, 1)
	dx, dwr := make([]float32, tokens*h), make([]float32, e*h)
	return gcase{
		vars: []gvar{{"x", x, dx}, {"weight", wr, dwr}},
		loss: func() float64 { moe.RouterForward(&rt, x, wr, h); return project(r, rt.W) },
		backward: func() {
			moe.RouterForward(&rt, x, wr, h)
			moe.RouterBackward(dx, dwr, &rt, r, nil, x, wr, h)
		},
		branch: func() string { return fmt.Sprint(rt.Idx) },
	}
}

func expertsCase(rng *rand.Rand, tokens, h, in, e, k int) gcase {
	x := randn(rng, tokens*h, 1)
	gu, dn := randn(rng, e*2*in*h, 0.5), randn(rng, e*h*in, 0.5)
	rt := moe.NewRouting[float32](tokens, e, k, true)
	for t := range tokens { // fixed routing; expert e-1 gets no token
		perm := rng.Perm(e - 1)
		for j := range k {
			rt.Idx[t*k+j] = int32(perm[j])
			rt.W[t*k+j] = float32(0.2 + rng.Float64())
		}
	}
	d := moe.NewDispatch[float32](tokens, h, in, e, k)
	s := moe.NewExpertScratch[float32](tokens, h, in, k)
	r := randn(rng, tokens*h, 1)
	out := make([]float32, tokens*h)
	dx, dw := make([]float32, tokens*h), make([]float32, tokens*k)
	dgu, ddn := randn(rng, e*2*in*h, 1), randn(rng, e*h*in, 1) // garbage: backward must overwrite
	idle := e - 1
	return gcase{
		vars: []gvar{{"x", x, dx}, {"gate_up", gu, dgu}, {"down", dn, ddn}, {"routing weights", rt.W, dw}},
		loss: func() float64 {
			moe.ExpertsForward(out, x, &rt, &d, gu, dn, h, in)
			return project(r, out)
		},
		backward: func() {
			copy(dgu[idle*2*in*h:], randn(rng, 2*in*h, 1))
			moe.ExpertsBackward(dx, dw, dgu, ddn, &s, r, &rt, &d, gu, dn, h, in)
			for _, g := range append(slices.Clone(dgu[idle*2*in*h:]), ddn[idle*h*in:]...) {
				if g != 0 {
					panic("gradient of an expert without tokens is not zero")
				}
			}
		},
	}
}

func headCase(rng *rand.Rand, tokens, h, v int) gcase {
	x, w := randn(rng, tokens*h, 1), randn(rng, v*h, 0.5)
	r := randn(rng, tokens*v, 1)
	logits := make([]float32, tokens*v)
	dx, dw := make([]float32, tokens*h), make([]float32, v*h)
	return gcase{
		vars:     []gvar{{"x", x, dx}, {"weight", w, dw}},
		loss:     func() float64 { headForward(logits, x, w, h, v); return project(r, logits) },
		backward: func() { headBackward(dx, dw, r, x, w, h, v) },
	}
}

func lossCase(rng *rand.Rand, tokens, v int) gcase {
	logits := randn(rng, tokens*v, 2)
	tgt := randTokens(rng, tokens, v)
	work := make([]float32, tokens*v)
	grad := make([]float32, tokens*v)
	return gcase{
		vars: []gvar{{"logits", logits, grad}},
		loss: func() float64 { copy(work, logits); return crossEntropy(work, tgt, v) },
		backward: func() {
			copy(grad, logits)
			crossEntropy(grad, tgt, v)
		},
	}
}

// keepGrads is an ExpertGrads that keeps every layer's gradients.
type keepGrads struct {
	m     *Model
	gu    [][]float32
	down  [][]float32
	order []int
}

func newKeepGrads(m *Model) *keepGrads {
	k := &keepGrads{m: m}
	for _, b := range m.Blocks {
		k.gu = append(k.gu, make([]float32, b.GateUp.Numel()))
		k.down = append(k.down, make([]float32, b.Down.Numel()))
	}
	return k
}

func (k *keepGrads) Buffers(l int) ([]float32, []float32, error) { return k.gu[l], k.down[l], nil }
func (k *keepGrads) Ready(l int, _, _ []float32) error {
	k.order = append(k.order, l)
	return nil
}

func modelCase(t *testing.T, rng *rand.Rand, layers, batch, seq int) gcase {
	cfg := Config{Vocab: 11, Hidden: 6, Intermediate: 5, Layers: layers, Experts: 4, TopK: 2, MixWindow: 3, NormEps: 1e-6}
	m, err := New(cfg, rng.Uint64())
	if err != nil {
		t.Fatal(err)
	}
	// Larger residual projections than at initialization, so every path
	// carries a gradient well above float32 noise.
	for _, p := range m.Params() {
		if p.Name != "embed" && len(p.Shape) > 1 {
			copy(p.W, randn(rng, p.Numel(), 0.4))
		}
	}
	pass, err := m.NewPass(batch, seq)
	if err != nil {
		t.Fatal(err)
	}
	in, tgt := randTokens(rng, batch*seq, cfg.Vocab), randTokens(rng, batch*seq, cfg.Vocab)
	kg := newKeepGrads(m)
	var vars []gvar
	for _, p := range m.Params() {
		g := p.G
		if p.Expert {
			l := 0
			fmt.Sscanf(p.Name, "blocks.%d.", &l)
			g = kg.gu[l]
			if p == m.Blocks[l].Down {
				g = kg.down[l]
			}
		}
		vars = append(vars, gvar{p.Name, p.W, g})
	}
	loss := func() float64 {
		v, err := pass.Forward(in, tgt)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	return gcase{
		vars: vars,
		loss: loss,
		backward: func() {
			if err := pass.Backward(kg); err != nil {
				t.Fatal(err)
			}
			want := []int{}
			for l := layers - 1; l >= 0; l-- {
				want = append(want, l)
			}
			if !slices.Equal(kg.order, want) {
				t.Errorf("expert gradients handed over in layer order %v, want %v", kg.order, want)
			}
		},
		branch: func() string {
			var s string
			for _, la := range pass.layers {
				s += fmt.Sprint(la.rt.Idx)
			}
			return s
		},
	}
}
