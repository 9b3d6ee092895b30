package hfmoe

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/sonar-moe/sonar/train/internal/gradcheck"
	"github.com/sonar-moe/sonar/train/kernels"
)

// Gradient checks in float64 (package gradcheck): every layer's backward
// against central finite differences of its forward, on random coordinates
// of every input. The router and the experts are checked in package moe.

func TestRMSNormGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	T, h := 3, 8
	x, g, R := gradcheck.Randn(rng, T*h, 1), gradcheck.Randn(rng, h, 1), gradcheck.Randn(rng, T*h, 1)
	y, r := make([]float64, T*h), make([]float64, T)
	dx, dg := make([]float64, T*h), make([]float64, h)
	gradcheck.Check(t, gradcheck.Case{
		Vars: []gradcheck.Var{gradcheck.V("x", x, dx), gradcheck.V("g", g, dg)},
		Loss: func() float64 { kernels.RMSNormForward(y, r, x, g, h, 1e-5); return gradcheck.Dot(R, y) },
		Backward: func() {
			kernels.RMSNormForward(y, r, x, g, h, 1e-5)
			clear(dx)
			clear(dg)
			kernels.RMSNormBackward(dx, dg, R, x, g, r, h)
		},
	}, rng, 12)
}

func TestRopeGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	seq, w, d := 5, 12, 6
	cos, sin := ropeTables[float64](seq, d, 10000)
	x, R := gradcheck.Randn(rng, 2*seq*w, 1), gradcheck.Randn(rng, 2*seq*w, 1)
	y, dx := make([]float64, len(x)), make([]float64, len(x))
	gradcheck.Check(t, gradcheck.Case{
		Vars: []gradcheck.Var{gradcheck.V("x", x, dx)},
		Loss: func() float64 { copy(y, x); ropeForward(y, cos, sin, seq, w, d); return gradcheck.Dot(R, y) },
		Backward: func() {
			copy(dx, R)
			ropeBackward(dx, cos, sin, seq, w, d)
		},
	}, rng, 20)
}

func TestAttentionGrad(t *testing.T) {
	for _, c := range []struct{ kvHeads, seq int }{{4, 5}, {2, 5}, {1, 5}, {2, 80}} {
		kvHeads := c.kvHeads
		t.Run(fmt.Sprintf("kv%d_seq%d", kvHeads, c.seq), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, uint64(kvHeads*c.seq)))
			a := attnShape{batch: 2, seq: c.seq, heads: 4, kvHeads: kvHeads, d: 4, scale: 0.5}
			T := a.batch * a.seq
			q, k, v := gradcheck.Randn(rng, T*a.heads*a.d, 1), gradcheck.Randn(rng, T*kvHeads*a.d, 1), gradcheck.Randn(rng, T*kvHeads*a.d, 1)
			R := gradcheck.Randn(rng, T*a.heads*a.d, 1)
			o, p, dp := make([]float64, len(q)), make([]float64, a.batch*a.heads*a.seq*a.seq), make([]float64, a.batch*a.heads*a.seq*a.seq)
			dq, dk, dv := make([]float64, len(q)), make([]float64, len(k)), make([]float64, len(v))
			gradcheck.Check(t, gradcheck.Case{
				Vars: []gradcheck.Var{gradcheck.V("q", q, dq), gradcheck.V("k", k, dk), gradcheck.V("v", v, dv)},
				Loss: func() float64 { attentionForward(o, p, q, k, v, a); return gradcheck.Dot(R, o) },
				Backward: func() {
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
			// The forward itself, against attention written out.
			attentionForward(o, p, q, k, v, a)
			want := naiveAttention(q, k, v, a)
			for i := range want {
				if math.Abs(o[i]-want[i]) > 1e-12*max(1, math.Abs(want[i])) {
					t.Fatalf("output %d: %v, want %v", i, o[i], want[i])
				}
			}
		})
	}
}

// naiveAttention is causal softmax attention by its definition, for
// TestAttentionGrad.
func naiveAttention(q, k, v []float64, a attnShape) []float64 {
	s, d, hw, kw := a.seq, a.d, a.heads*a.d, a.kvHeads*a.d
	out := make([]float64, len(q))
	for b := range a.batch {
		for h := range a.heads {
			g := h / (a.heads / a.kvHeads)
			for r := range s {
				sc := make([]float64, r+1)
				mx := math.Inf(-1)
				for c := range sc {
					for i := range d {
						sc[c] += q[(b*s+r)*hw+h*d+i] * k[(b*s+c)*kw+g*d+i]
					}
					sc[c] *= a.scale
					mx = max(mx, sc[c])
				}
				var sum float64
				for c := range sc {
					sc[c] = math.Exp(sc[c] - mx)
					sum += sc[c]
				}
				for c := range sc {
					for i := range d {
						out[(b*s+r)*hw+h*d+i] += sc[c] / sum * v[(b*s+c)*kw+g*d+i]
					}
				}
			}
		}
	}
	return out
}

func TestCrossEntropyGrad(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	T, v := 5, 7
	logits := gradcheck.Randn(rng, T*v, 2)
	tgt := []int32{3, -100, 0, 6, -1}
	lse, g := make([]float64, T), make([]float64, T*v)
	gradcheck.Check(t, gradcheck.Case{
		Vars: []gradcheck.Var{gradcheck.V("logits", logits, g)},
		Loss: func() float64 { l, _ := crossEntropy(logits, lse, tgt, v); return l },
		Backward: func() {
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
			var c gradcheck.Case
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
				c.Vars = append(c.Vars, gradcheck.V(p.Name, p.W, g))
			}
			c.Loss = func() float64 {
				l, err := pass.Forward(in, tg)
				if err != nil {
					t.Fatal(err)
				}
				return l.Total
			}
			c.Backward = func() {
				c.Loss()
				if err := pass.Backward(kg); err != nil {
					t.Fatal(err)
				}
			}
			c.Skip = func(name string, i int) bool {
				return name == m.Embed.Name && i/cfg.Hidden == cfg.PadTokenID
			}
			c.Branch = func() string {
				var s string
				for _, la := range pass.layers {
					s += fmt.Sprint(la.rt.Idx)
				}
				return s
			}
			gradcheck.Check(t, c, rng, 6)
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
