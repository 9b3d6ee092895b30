// Package hfmoe is the Mixture-of-Experts decoders of Hugging Face
// transformers 5.x that Sonar-MoE fine-tunes in Go, OLMoE (OlmoeForCausalLM)
// and GraniteMoe (GraniteMoeForCausalLM), forward and backward: RMSNorm,
// attention with rotary embeddings, grouped key/value heads and a causal
// mask (OLMoE: with q/k RMSNorm); a top-k softmax router (norm_topk_prob as
// configured; GraniteMoe: softmax over the top-k logits); SiLU-gated experts
// in the batched layout ([E, 2I, H] gate_up, [E, H, I] down); GraniteMoe's
// embedding, residual, attention and logits multipliers; the load-balancing
// auxiliary loss when the config enables it. It reads and writes
// save_pretrained checkpoints (checkpoint.go).
//
// The model is generic over its element type: float32 to train (the AdamW
// engine steps float32 weights in place), float64 for finite-difference
// gradient checks. As in package train/model, Backward does not keep expert
// gradients: it asks an ExpertGrads for one layer's buffers at a time and
// hands them back the moment they are final, last layer first. Dense
// gradients accumulate in each Param's G.
package hfmoe

import (
	"fmt"
	"math/rand/v2"
	"unsafe"

	"github.com/sonar-moe/sonar/train/kernels"
)

// Float is the element type of a model: float32 to train, float64 for
// finite-difference gradient checks.
type Float = kernels.Float

// Param is one parameter tensor, named as in OlmoeForCausalLM's state dict
// (expert tensors by their batched names, "...mlp.experts.gate_up_proj").
// G is nil for expert tensors, whose gradients go to an ExpertGrads.
type Param[F Float] struct {
	Name   string
	Shape  []int
	W      []F
	G      []F
	Expert bool
}

// Numel is the number of elements.
func (p *Param[F]) Numel() int { return len(p.W) }

// Layer is one decoder layer.
type Layer[F Float] struct {
	InNorm   *Param[F] // input_layernorm [H]
	Q        *Param[F] // self_attn.q_proj [H, H]
	K        *Param[F] // self_attn.k_proj [KV, H]
	V        *Param[F] // self_attn.v_proj [KV, H]
	O        *Param[F] // self_attn.o_proj [H, H]
	QNorm    *Param[F] // self_attn.q_norm [H] (nil for GraniteMoe)
	KNorm    *Param[F] // self_attn.k_norm [KV] (nil for GraniteMoe)
	PostNorm *Param[F] // post_attention_layernorm [H]
	Router   *Param[F] // mlp.gate [E, H] (GraniteMoe: block_sparse_moe.router)
	GateUp   *Param[F] // mlp.experts.gate_up_proj [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
	Down     *Param[F] // mlp.experts.down_proj [E, H, I]
}

// Model is an OlmoeForCausalLM or a GraniteMoeForCausalLM.
type Model[F Float] struct {
	Cfg       Config
	Embed     *Param[F] // model.embed_tokens [V, H]
	Layers    []Layer[F]
	FinalNorm *Param[F] // model.norm [H]
	Head      *Param[F] // lm_head [V, H]; the embedding itself when tied
	params    []*Param[F]
}

// New builds a model with the given config and zero weights (norm weights
// one). Init draws random weights.
func New[F Float](cfg Config) (*Model[F], error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("hfmoe: %w", err)
	}
	m := &Model[F]{Cfg: cfg}
	h, kv, e, in, v := cfg.Hidden, cfg.KVDim(), cfg.Experts, cfg.Intermediate, cfg.Vocab
	add := func(name string, expert bool, shape ...int) *Param[F] {
		n := 1
		for _, d := range shape {
			n *= d
		}
		// Weights at 256..704 and gradients at 2048..2496 bytes mod 4 KiB,
		// apart from each other and from the optimizer's state buffers (see
		// kernels.AllocAt).
		k := len(m.params) % 8
		p := &Param[F]{Name: name, Shape: shape, W: kernels.AllocAt[F](n, 256+64*k), Expert: expert}
		if !expert {
			p.G = kernels.AllocAt[F](n, 2048+64*k)
		}
		m.params = append(m.params, p)
		return p
	}
	norm := func(name string, n int) *Param[F] {
		p := add(name, false, n)
		for i := range p.W {
			p.W[i] = 1
		}
		return p
	}
	m.Embed = add("model.embed_tokens.weight", false, v, h)
	moe, router := "mlp.", "mlp.gate.weight"
	if cfg.Arch == ArchGraniteMoE {
		moe, router = "block_sparse_moe.", "block_sparse_moe.router.weight"
	}
	for l := range cfg.Layers {
		pre := fmt.Sprintf("model.layers.%d.", l)
		ly := Layer[F]{
			InNorm: norm(pre+"input_layernorm.weight", h),
			Q:      add(pre+"self_attn.q_proj.weight", false, h, h),
			K:      add(pre+"self_attn.k_proj.weight", false, kv, h),
			V:      add(pre+"self_attn.v_proj.weight", false, kv, h),
			O:      add(pre+"self_attn.o_proj.weight", false, h, h),
		}
		if cfg.QKNorm() {
			ly.QNorm = norm(pre+"self_attn.q_norm.weight", h)
			ly.KNorm = norm(pre+"self_attn.k_norm.weight", kv)
		}
		ly.PostNorm = norm(pre+"post_attention_layernorm.weight", h)
		ly.Router = add(pre+router, false, e, h)
		ly.GateUp = add(pre+moe+"experts.gate_up_proj", true, e, 2*in, h)
		ly.Down = add(pre+moe+"experts.down_proj", true, e, h, in)
		m.Layers = append(m.Layers, ly)
	}
	m.FinalNorm = norm("model.norm.weight", h)
	if cfg.TieEmbeddings {
		m.Head = m.Embed
	} else {
		m.Head = add("lm_head.weight", false, v, h)
	}
	return m, nil
}

// Init draws every weight but the norms from N(0, std^2) (transformers uses
// std = initializer_range, 0.02), deterministically from seed.
func (m *Model[F]) Init(seed uint64, std float64) {
	rng := rand.New(rand.NewPCG(seed, 0x01e0e))
	for _, p := range m.params {
		if len(p.Shape) == 1 {
			continue
		}
		for i := range p.W {
			p.W[i] = F(rng.NormFloat64() * std)
		}
	}
}

// Params lists every parameter once, in state-dict order (the tied head is
// the embedding and is not listed again).
func (m *Model[F]) Params() []*Param[F] { return m.params }

// Param returns the parameter of the given name, or nil.
func (m *Model[F]) Param(name string) *Param[F] {
	for _, p := range m.params {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// ExpertBytes is the size of one layer's expert gradients in bytes.
func (m *Model[F]) ExpertBytes() int64 {
	var z F
	return int64(unsafe.Sizeof(z)) * int64(m.Layers[0].GateUp.Numel()+m.Layers[0].Down.Numel())
}

// Counts returns the number of parameters in total and in expert tensors.
func (m *Model[F]) Counts() (total, expert int) {
	for _, p := range m.params {
		total += p.Numel()
		if p.Expert {
			expert += p.Numel()
		}
	}
	return total, expert
}
