// Package model is the Go-native byte-level Mixture-of-Experts language model
// of the Go trainer: its configuration, parameters and initialization, and
// the forward and backward passes in float32 (layers in their own files:
// embedding, RMSNorm, causal mixing, head and loss; the router and the
// batched experts are package moe's, which the OLMoE model shares).
//
// Expert weights are batched [E, ...] tensors (gate_up [E, 2I, H], down
// [E, H, I]), as in Hugging Face OLMoE. Backward does not keep their
// gradients: it asks an ExpertGrads for a buffer per layer and hands the
// buffer back the moment that layer's expert gradients are final, last layer
// first, so the caller can apply the optimizer and reuse the memory. Dense
// gradients are kept in each Param's G for a global-norm clipped step after
// backward. Matrix products go through kernels.Gemm.
package model

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/sonar-moe/sonar/train/kernels"
)

// Config is the model's shape.
type Config struct {
	Vocab        int     // tokens (256 for bytes)
	Hidden       int     // H, width of the residual stream
	Intermediate int     // I, width of each expert's feed-forward
	Layers       int     // blocks
	Experts      int     // E, experts per block
	TopK         int     // experts per token
	MixWindow    int     // tokens seen by the causal mixing layer (1 = the token itself)
	NormEps      float32 // RMSNorm epsilon
}

// DefaultConfig is the byte-level model the trainer uses by default.
func DefaultConfig() Config {
	return Config{Vocab: 256, Hidden: 64, Intermediate: 128, Layers: 4, Experts: 8, TopK: 2, MixWindow: 8, NormEps: 1e-6}
}

// Validate checks that the shape is usable.
func (c Config) Validate() error {
	switch {
	case c.Vocab < 2:
		return fmt.Errorf("vocab %d: want at least 2", c.Vocab)
	case c.Hidden < 1 || c.Intermediate < 1 || c.Layers < 1:
		return fmt.Errorf("hidden %d, intermediate %d, layers %d: all must be positive", c.Hidden, c.Intermediate, c.Layers)
	case c.Experts < 1:
		return fmt.Errorf("experts %d: want at least 1", c.Experts)
	case c.TopK < 1 || c.TopK > c.Experts:
		return fmt.Errorf("top-k %d: want 1..experts (%d)", c.TopK, c.Experts)
	case c.MixWindow < 1:
		return fmt.Errorf("mix window %d: want at least 1", c.MixWindow)
	case !(c.NormEps > 0):
		return fmt.Errorf("norm eps %v: want > 0", c.NormEps)
	}
	return nil
}

// Param is one parameter tensor. W is the weight memory (the optimizer
// updates it in place); G is its gradient for dense parameters and nil for
// expert tensors, whose gradients Backward hands to an ExpertGrads.
type Param struct {
	Name   string
	Shape  []int
	W      []float32
	G      []float32
	Expert bool
}

// Numel is the number of elements.
func (p *Param) Numel() int { return len(p.W) }

// Block is one transformer-style block: x += Mix(RMSNorm(x)); x += MoE(RMSNorm(x)).
type Block struct {
	MixNorm *Param // [H]
	MixConv *Param // [K, H] depthwise causal weights, K = MixWindow
	MixOut  *Param // [H, H]
	MoENorm *Param // [H]
	Router  *Param // [E, H]
	GateUp  *Param // [E, 2I, H] expert: rows 0..I-1 gate, I..2I-1 up
	Down    *Param // [E, H, I] expert
}

// Model is the byte-level MoE language model.
type Model struct {
	Cfg       Config
	Embed     *Param // [V, H]
	Blocks    []Block
	FinalNorm *Param // [H]
	Head      *Param // [V, H]
	params    []*Param
}

// New builds a model with weights drawn from seed.
func New(cfg Config, seed uint64) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("model config: %w", err)
	}
	rng := rand.New(rand.NewPCG(seed, 0x5ca1ab1e))
	m := &Model{Cfg: cfg}
	v, h, in, e, k := cfg.Vocab, cfg.Hidden, cfg.Intermediate, cfg.Experts, cfg.MixWindow
	n := 0
	add := func(name string, expert bool, std float64, shape ...int) *Param {
		numel := 1
		for _, d := range shape {
			numel *= d
		}
		// Weights at 256..704 and gradients at 2048..2496 bytes mod 4 KiB:
		// apart from each other and from the optimizer's state buffers.
		p := &Param{Name: name, Shape: shape, W: kernels.AllocAt[float32](numel, 256+64*(n%8)), Expert: expert}
		if !expert {
			p.G = kernels.AllocAt[float32](numel, 2048+64*(n%8))
		}
		n++
		for i := range p.W {
			if std == 0 {
				p.W[i] = 1
			} else {
				p.W[i] = float32(rng.NormFloat64() * std)
			}
		}
		m.params = append(m.params, p)
		return p
	}
	const resid = 0.02 // std of projections that write into the residual stream
	m.Embed = add("embed", false, 1, v, h)
	for l := range cfg.Layers {
		pre := fmt.Sprintf("blocks.%d.", l)
		m.Blocks = append(m.Blocks, Block{
			MixNorm: add(pre+"mix_norm", false, 0, h),
			MixConv: add(pre+"mix.conv", false, 1/math.Sqrt(float64(k)), k, h),
			MixOut:  add(pre+"mix.out", false, resid, h, h),
			MoENorm: add(pre+"moe_norm", false, 0, h),
			Router:  add(pre+"moe.router", false, 1/math.Sqrt(float64(h)), e, h),
			GateUp:  add(pre+"moe.experts.gate_up_proj", true, 1/math.Sqrt(float64(h)), e, 2*in, h),
			Down:    add(pre+"moe.experts.down_proj", true, resid, e, h, in),
		})
	}
	m.FinalNorm = add("final_norm", false, 0, h)
	m.Head = add("head", false, resid, v, h)
	return m, nil
}

// Params lists every parameter in a fixed order (embedding, blocks, final
// norm, head).
func (m *Model) Params() []*Param { return m.params }

// ExpertBytes is the size of one layer's expert gradients (gate_up and down).
func (m *Model) ExpertBytes() int64 {
	b := m.Blocks[0]
	return int64(4 * (b.GateUp.Numel() + b.Down.Numel()))
}

// Counts returns the number of parameters in total and in expert tensors.
func (m *Model) Counts() (total, expert int) {
	for _, p := range m.params {
		total += p.Numel()
		if p.Expert {
			expert += p.Numel()
		}
	}
	return total, expert
}
