package hfmoe

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// Gradient checks in float64: every layer's backward against central finite
// differences of its forward, on random coordinates of every input. Layers
// whose output is a tensor are reduced to a scalar with a fixed random
// projection, L = sum(R * out).

type gvar struct {
	name string
	x    []float64
	grad []float64
}

type gcase struct {
	vars     []gvar
	loss     func() float64
	backward func()
	branch   func() string // piecewise-constant choices (top-k); coordinates that change it are skipped
	// skip, when set, names coordinates whose gradient is not the
	// derivative by design (the padding row of the embedding).
	skip func(name string, i int) bool
}

func randn(rng *rand.Rand, n int, std float64) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = rng.NormFloat64() * std
	}
	return x
}

func dot(a, b []float64) float64 {
	var s float64
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

func checkGrad(t *testing.T, c gcase, rng *rand.Rand, coords int) {
	t.Helper()
	c.backward()
	const eps = 1e-6
	for _, v := range c.vars {
		grad := slices.Clone(v.grad)
		checked := 0
		for range coords {
			i := rng.IntN(len(v.x))
			if c.skip != nil && c.skip(v.name, i) {
				continue
			}
			old := v.x[i]
			var before string
			if c.branch != nil {
				before = c.branch()
			}
			v.x[i] = old + eps
			lp := c.loss()
			bp := ""
			if c.branch != nil {
				bp = c.branch()
			}
			v.x[i] = old - eps
			lm := c.loss()
			bm := ""
			if c.branch != nil {
				bm = c.branch()
			}
			v.x[i] = old
			if c.branch != nil && (bp != before || bm != before) {
				continue
			}
			num := (lp - lm) / (2 * eps)
			if d := math.Abs(num - grad[i]); d > 1e-6*max(1, math.Abs(num)) {
				t.Errorf("%s[%d]: analytic %.10g, numeric %.10g", v.name, i, grad[i], num)
			}
			checked++
		}
		if checked == 0 {
			t.Errorf("%s: no coordinate checked", v.name)
		}
	}
	c.loss() // leave the forward state at the unperturbed values
}

func TestRMSNormGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	T, h := 3, 8
	x, g, R := randn(rng, T*h, 1), randn(rng, h, 1), randn(rng, T*h, 1)
	y, r := make([]float64, T*h), make([]float64, T)
	dx, dg := make([]float64, T*h), make([]float64, h)
	checkGrad(t, gcase{
		vars: []gvar{{"x", x, dx}, {"g", g, dg}},
		loss: func() float64 { rmsNormForward(y, r, x, g, h, 1e-5); return dot(R, y) },
		backward: func() {
			rmsNormForward(y, r, x, g, h, 1e-5)
			clear(dx)
			clear(dg)
			rmsNormBackward(dx, dg, R, x, g, r, h)
		},
	}, rng, 12)
}

func TestRopeGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	seq, w, d := 5, 12, 6
	cos, sin := ropeTables[float64](seq, d, 10000)
	x, R := randn(rng, 2*seq*w, 1), randn(rng, 2*seq*w, 1)
	y, dx := make([]float64, len(x)), make([]float64, len(x))
	checkGrad(t, gcase{
		vars: []gvar{{"x", x, dx}},
		loss: func() float64 { copy(y, x); ropeForward(y, cos, sin, seq, w, d); return dot(R, y) },
		backward: func() {
			copy(dx, R)
			ropeBackward(dx, cos, sin, seq, w, d)
		},
	}, rng, 20)
}

func TestAttentionGrad(t *testing.T) {
	for _, kvHeads := range []int{4, 2, 1} {
		t.Run(fmt.Sprintf("kv%d", kvHeads), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, uint64(kvHeads)))
			a := attnShape{batch: 2, seq: 5, heads: 4, kvHeads: kvHeads, d: 4, scale: 0.5}
			T := a.batch * a.seq
			q, k, v := randn(rng, T*a.heads*a.d, 1), randn(rng, T*kvHeads*a.d, 1), randn(rng, T*kvHeads*a.d, 1)
			R := randn(rng, T*a.heads*a.d, 1)
			o, p, dp := make([]float64, len(q)), make([]float64, a.batch*a.heads*a.seq*a.seq), make([]float64, a.batch*a.heads*a.seq*a.seq)
			dq, dk, dv := make([]float64, len(q)), make([]float64, len(k)), make([]float64, len(v))
			checkGrad(t, gcase{
				vars: []gvar{{"q", q, dq}, {"k", k, dk}, {"v", v, dv}},
				loss: func() float64 { attentionForward(o, p, q, k, v, a); return dot(R, o) },
				backward: func() {
					attentionForward(o, p, q, k, v, a)
					clear(dk)
					clear(dv)
					attentionBackward(dq, dk, dv, dp, R, p, q, k, v, a)
				},
			}, rng, 25)
			// Causality: the output of position 0 ignores every later key.
			if p[1] != 0 || p[a.seq-1] != 0 || p[0] != 1 {
				t.Errorf("first row of probabilities %v: want [1 0 ...]", p[:a.seq])
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
			x, wr := randn(rng, T*h, 1), randn(rng, e*h, 1)
			Rw := randn(rng, T*tc.k, 1)
			var aux []float64
			if tc.aux {
				aux = randn(rng, e, 1)
			}
			rt := newRouting[float64](T, e, tc.k, tc.norm)
			dx, dwr := make([]float64, T*h), make([]float64, e*h)
			loss := func() float64 {
				routerForward(&rt, x, wr, h)
				l := dot(Rw, rt.w)
				for i, pv := range rt.probs {
					if aux != nil {
						l += aux[i%e] * pv
					}
				}
				return l
			}
			checkGrad(t, gcase{
				vars: []gvar{{"x", x, dx}, {"router", wr, dwr}},
				loss: loss,
				backward: func() {
					loss()
					clear(dx)
					clear(dwr)
					routerBackward(dx, dwr, &rt, Rw, aux, x, wr, h)
				},
				branch: func() string { return fmt.Sprint(rt.idx) },
			}, rng, 20)
		})
	}
}

func TestExpertsGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	T, h, in, e, k := 7, 6, 5, 4, 2
	x, gu, dn := randn(rng, T*h, 1), randn(rng, e*2*in*h, 0.5), randn(rng, e*h*in, 0.5)
	R := randn(rng, T*h, 1)
	rt := newRouting[float64](T, e, k, true)
	// Fixed routing that leaves expert 3 idle; weights are inputs too.
	for t := range T {
		rt.idx[t*k], rt.idx[t*k+1] = int32(t%3), int32((t+1)%3)
	}
	w := randn(rng, T*k, 1)
	d := newDispatch[float64](T, h, in, e, k)
	s := newExpertScratch[float64](T, h, in, k)
	out := make([]float64, T*h)
	dx, dw, dgu, ddn := make([]float64, T*h), make([]float64, T*k), make([]float64, len(gu)), make([]float64, len(dn))
	loss := func() float64 {
		copy(rt.w, w)
		expertsForward(out, x, &rt, &d, gu, dn, h, in)
		return dot(R, out)
	}
	checkGrad(t, gcase{
		vars: []gvar{{"x", x, dx}, {"w", w, dw}, {"gate_up", gu, dgu}, {"down", dn, ddn}},
		loss: loss,
		backward: func() {
			loss()
			clear(dx)
			for i := range ddn {
				ddn[i] = 7 // must be overwritten
			}
			expertsBackward(dx, dw, dgu, ddn, &s, R, &rt, &d, gu, dn, h, in)
		},
	}, rng, 30)
	idle := 3
	for i := idle * 2 * in * h; i < (idle+1)*2*in*h; i++ {
		if dgu[i] != 0 {
			t.Fatalf("idle expert's gate_up gradient %v at %d: want 0", dgu[i], i)
		}
	}
}

func TestCrossEntropyGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	T, v := 5, 7
	logits := randn(rng, T*v, 2)
	tgt := []int32{3, -100, 0, 6, -1}
	lse, g := make([]float64, T), make([]float64, T*v)
	checkGrad(t, gcase{
		vars: []gvar{{"logits", logits, g}},
		loss: func() float64 { l, _ := crossEntropy(logits, lse, tgt, v); return l },
		backward: func() {
			_, n := crossEntropy(logits, lse, tgt, v)
			copy(g, logits)
			crossEntropyBackward(g, lse, tgt, v, n, 1)
		},
	}, rng, 20)
}

// keepGrads is an ExpertGrads that keeps every layer's gradients and
// records the order of the calls.
type keepGrads[F Float] struct {
	m      *Model[F]
	gu, dn [][]F
	order  []string
}

func newKeepGrads[F Float](m *Model[F]) *keepGrads[F] {
	k := &keepGrads[F]{m: m}
	for _, l := range m.Layers {
		k.gu = append(k.gu, make([]F, l.GateUp.Numel()))
		k.dn = append(k.dn, make([]F, l.Down.Numel()))
	}
	return k
}

func (k *keepGrads[F]) Buffers(l int) ([]F, []F, error) {
	k.order = append(k.order, fmt.Sprintf("buffers %d", l))
	return k.gu[l], k.dn[l], nil
}

func (k *keepGrads[F]) Ready(l int, gu, dn []F) error {
	k.order = append(k.order, fmt.Sprintf("ready %d", l))
	return nil
}

func tinyConfig() Config {
	return Config{Arch: ArchOLMoE, Vocab: 11, Hidden: 8, Intermediate: 6, Layers: 2, Heads: 4, KVHeads: 2, Experts: 4, TopK: 2,
		NormEps: 1e-5, RopeTheta: 10000, RouterAuxCoef: 0.01, PadTokenID: 1}
}

func TestModelGrad(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
	}{
		{"default", func(*Config) {}},
		{"norm_topk_aux", func(c *Config) { c.NormTopKProb, c.AuxLoss, c.RouterAuxCoef = true, true, 0.5 }},
		{"tied_mha_1layer", func(c *Config) { c.TieEmbeddings, c.KVHeads, c.Layers, c.PadTokenID = true, 4, 1, -1 }},
		{"granitemoe", func(c *Config) {
			c.Arch, c.NormTopKProb, c.AuxLoss, c.RouterAuxCoef = ArchGraniteMoE, true, true, 0.3
			c.EmbeddingMultiplier, c.ResidualMultiplier, c.AttentionMultiplier, c.LogitsScaling = 3, 0.5, 0.3, 2
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tinyConfig()
			tc.edit(&cfg)
			m, err := New[float64](cfg)
			if err != nil {
				t.Fatal(err)
			}
			m.Init(3, 0.5)
			rng := rand.New(rand.NewPCG(13, 14))
			for _, p := range m.Params() {
				if len(p.Shape) == 1 {
					for i := range p.W {
						p.W[i] = 1 + 0.3*rng.NormFloat64()
					}
				}
			}
			batch, seq := 2, 5
			pass, err := m.NewPass(batch, seq)
			if err != nil {
				t.Fatal(err)
			}
			in := make([]int32, batch*seq)
			tg := make([]int32, batch*seq)
			for i := range in {
				in[i] = int32(rng.IntN(cfg.Vocab))
				tg[i] = int32(rng.IntN(cfg.Vocab))
			}
			in[3] = 1 // the pad token, whose embedding gets no gradient
			tg[4] = -100
			kg := newKeepGrads(m)
			var c gcase
			for _, p := range m.Params() {
				g := p.G
				if p.Expert {
					for l, ly := range m.Layers {
						if ly.GateUp == p {
							g = kg.gu[l]
						} else if ly.Down == p {
							g = kg.dn[l]
						}
					}
				}
				c.vars = append(c.vars, gvar{p.Name, p.W, g})
			}
			c.loss = func() float64 {
				l, err := pass.Forward(in, tg)
				if err != nil {
					t.Fatal(err)
				}
				return l.Total
			}
			c.backward = func() {
				c.loss()
				if err := pass.Backward(kg); err != nil {
					t.Fatal(err)
				}
			}
			c.skip = func(name string, i int) bool {
				return name == m.Embed.Name && i/cfg.Hidden == cfg.PadTokenID
			}
			c.branch = func() string {
				var s string
				for _, la := range pass.layers {
					s += fmt.Sprint(la.rt.idx)
				}
				return s
			}
			checkGrad(t, c, rng, 6)
			want := []string{"buffers 1", "ready 1", "buffers 0", "ready 0"}[4-2*cfg.Layers:]
			if !slices.Equal(kg.order, want) {
				t.Errorf("expert hand-over order %v, want %v", kg.order, want)
			}
			if cfg.PadTokenID >= 0 {
				h := cfg.Hidden
				for _, g := range m.Embed.G[cfg.PadTokenID*h : (cfg.PadTokenID+1)*h] {
					if g != 0 && !cfg.TieEmbeddings {
						t.Fatalf("pad token's embedding gradient %v: want 0", g)
					}
				}
			}
		})
	}
}
