package hfmoe

import (
	"encoding/json"
	"fmt"
	"math"
)

// Architectures.
const (
	ArchOLMoE      = "olmoe"      // OlmoeForCausalLM
	ArchGraniteMoE = "granitemoe" // GraniteMoeForCausalLM
)

// Config is the shape and the options of a model, read from the config.json
// that transformers' save_pretrained writes (OlmoeConfig or
// GraniteMoeConfig).
type Config struct {
	// Arch is ArchOLMoE (the zero value) or ArchGraniteMoE. GraniteMoe is
	// OLMoE without the q/k norms, with four scalar multipliers (below),
	// and a router whose weights are the softmax of the top-k logits (the
	// same values as OLMoE's renormalized top-k probabilities).
	Arch         string
	Vocab        int     // vocab_size
	Hidden       int     // hidden_size, H
	Intermediate int     // intermediate_size, I (of each expert)
	Layers       int     // num_hidden_layers
	Heads        int     // num_attention_heads
	KVHeads      int     // num_key_value_heads
	Experts      int     // num_experts, E
	TopK         int     // num_experts_per_tok
	NormEps      float64 // rms_norm_eps
	RopeTheta    float64 // rope_parameters.rope_theta (rope_type "default")
	NormTopKProb bool    // norm_topk_prob: renormalize the top-k probabilities to sum to one
	// AuxLoss (output_router_logits) adds RouterAuxCoef times the
	// load-balancing loss to the loss, as OlmoeForCausalLM does when it
	// outputs router logits and has labels.
	AuxLoss       bool
	RouterAuxCoef float64 // router_aux_loss_coef
	TieEmbeddings bool    // tie_word_embeddings: lm_head is the embedding
	PadTokenID    int     // pad_token_id (its embedding row gets no gradient); -1: none

	// GraniteMoe's multipliers; 0 means absent (1, and head_dim^-0.5 for
	// the attention scale).
	EmbeddingMultiplier float64 // embedding_multiplier: the embeddings are scaled by it
	ResidualMultiplier  float64 // residual_multiplier: attention and MoE outputs are scaled by it before the residual add
	AttentionMultiplier float64 // attention_multiplier: the attention scale instead of head_dim^-0.5
	LogitsScaling       float64 // logits_scaling: the logits are divided by it
}

// QKNorm says whether attention normalizes queries and keys (OLMoE).
func (c Config) QKNorm() bool { return c.Arch != ArchGraniteMoE }

func orOne(v float64) float64 {
	if v == 0 {
		return 1
	}
	return v
}

// HeadDim is the width of one attention head.
func (c Config) HeadDim() int { return c.Hidden / c.Heads }

// KVDim is the width of the key and value projections.
func (c Config) KVDim() int { return c.KVHeads * c.HeadDim() }

// Validate checks that the model can be built.
func (c Config) Validate() error {
	switch {
	case c.Arch != ArchOLMoE && c.Arch != ArchGraniteMoE && c.Arch != "":
		return fmt.Errorf("architecture %q: want %q or %q", c.Arch, ArchOLMoE, ArchGraniteMoE)
	case c.EmbeddingMultiplier < 0 || c.ResidualMultiplier < 0 || c.AttentionMultiplier < 0 || c.LogitsScaling < 0:
		return fmt.Errorf("multipliers must not be negative")
	case c.Vocab < 2:
		return fmt.Errorf("vocab_size %d: want at least 2", c.Vocab)
	case c.Hidden < 1 || c.Intermediate < 1 || c.Layers < 1:
		return fmt.Errorf("hidden_size %d, intermediate_size %d, num_hidden_layers %d: all must be positive", c.Hidden, c.Intermediate, c.Layers)
	case c.Heads < 1 || c.Hidden%c.Heads != 0:
		return fmt.Errorf("num_attention_heads %d: must divide hidden_size %d", c.Heads, c.Hidden)
	case c.HeadDim()%2 != 0:
		return fmt.Errorf("head dim %d: rotary embeddings need an even width", c.HeadDim())
	case c.KVHeads < 1 || c.Heads%c.KVHeads != 0:
		return fmt.Errorf("num_key_value_heads %d: must divide num_attention_heads %d", c.KVHeads, c.Heads)
	case c.Experts < 1:
		return fmt.Errorf("num_experts %d: want at least 1", c.Experts)
	case c.TopK < 1 || c.TopK > c.Experts:
		return fmt.Errorf("num_experts_per_tok %d: want 1..num_experts (%d)", c.TopK, c.Experts)
	case !(c.NormEps > 0):
		return fmt.Errorf("rms_norm_eps %v: want > 0", c.NormEps)
	case !(c.RopeTheta > 0):
		return fmt.Errorf("rope_theta %v: want > 0", c.RopeTheta)
	case c.PadTokenID >= c.Vocab || c.PadTokenID < -1:
		return fmt.Errorf("pad_token_id %d: outside the vocabulary (%d)", c.PadTokenID, c.Vocab)
	case c.RouterAuxCoef < 0 || math.IsNaN(c.RouterAuxCoef):
		return fmt.Errorf("router_aux_loss_coef %v: want >= 0", c.RouterAuxCoef)
	}
	return nil
}

// hfConfig is the part of OlmoeConfig's JSON the Go model reads.
type hfConfig struct {
	ModelType          string          `json:"model_type"`
	Vocab              int             `json:"vocab_size"`
	Hidden             int             `json:"hidden_size"`
	Intermediate       int             `json:"intermediate_size"`
	Layers             int             `json:"num_hidden_layers"`
	Heads              int             `json:"num_attention_heads"`
	KVHeads            *int            `json:"num_key_value_heads"`
	HeadDim            *int            `json:"head_dim"`
	Experts            int             `json:"num_experts"`
	LocalExperts       int             `json:"num_local_experts"`
	EmbeddingMult      *float64        `json:"embedding_multiplier"`
	ResidualMult       *float64        `json:"residual_multiplier"`
	AttentionMult      *float64        `json:"attention_multiplier"`
	LogitsScaling      *float64        `json:"logits_scaling"`
	TopK               int             `json:"num_experts_per_tok"`
	NormEps            *float64        `json:"rms_norm_eps"`
	RopeTheta          *float64        `json:"rope_theta"`
	RopeParameters     *ropeParameters `json:"rope_parameters"`
	RopeScaling        json.RawMessage `json:"rope_scaling"`
	NormTopKProb       bool            `json:"norm_topk_prob"`
	OutputRouterLogits bool            `json:"output_router_logits"`
	RouterAuxCoef      *float64        `json:"router_aux_loss_coef"`
	TieEmbeddings      bool            `json:"tie_word_embeddings"`
	PadTokenID         *int            `json:"pad_token_id"`
	HiddenAct          string          `json:"hidden_act"`
	AttentionBias      bool            `json:"attention_bias"`
	ClipQKV            *float64        `json:"clip_qkv"`
}

type ropeParameters struct {
	RopeType  string   `json:"rope_type"`
	RopeTheta *float64 `json:"rope_theta"`
}

// ParseHFConfig reads an OLMoE or GraniteMoe config.json (transformers 4.x
// or 5.x form), with OlmoeConfig's or GraniteMoeConfig's defaults for absent
// fields, and refuses the options the Go model does not implement (clip_qkv,
// attention biases, rope scaling, activations other than SiLU).
func ParseHFConfig(b []byte) (Config, error) {
	var h hfConfig
	if err := json.Unmarshal(b, &h); err != nil {
		return Config{}, fmt.Errorf("config.json: %w", err)
	}
	if h.ModelType != ArchOLMoE && h.ModelType != ArchGraniteMoE {
		return Config{}, fmt.Errorf("config.json: model_type %q, want %q or %q", h.ModelType, ArchOLMoE, ArchGraniteMoE)
	}
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return Config{}, fmt.Errorf("config.json: hidden_act %q: only silu is implemented", h.HiddenAct)
	}
	if h.AttentionBias {
		return Config{}, fmt.Errorf("config.json: attention_bias is not implemented")
	}
	if h.ClipQKV != nil {
		return Config{}, fmt.Errorf("config.json: clip_qkv is not implemented")
	}
	if len(h.RopeScaling) > 0 && string(h.RopeScaling) != "null" {
		return Config{}, fmt.Errorf("config.json: rope_scaling is not implemented")
	}
	c := Config{Arch: ArchOLMoE, Vocab: h.Vocab, Hidden: h.Hidden, Intermediate: h.Intermediate, Layers: h.Layers, Heads: h.Heads,
		Experts: h.Experts, TopK: h.TopK, NormEps: 1e-5, RopeTheta: 10000, NormTopKProb: h.NormTopKProb,
		AuxLoss: h.OutputRouterLogits, RouterAuxCoef: 0.01, TieEmbeddings: h.TieEmbeddings, PadTokenID: -1}
	if h.ModelType == ArchGraniteMoE {
		c.Arch, c.Experts, c.NormEps, c.RouterAuxCoef = ArchGraniteMoE, h.LocalExperts, 1e-6, 0.001
		c.NormTopKProb = true // the softmax of the top-k logits
		for _, m := range []struct {
			dst *float64
			src *float64
		}{{&c.EmbeddingMultiplier, h.EmbeddingMult}, {&c.ResidualMultiplier, h.ResidualMult},
			{&c.AttentionMultiplier, h.AttentionMult}, {&c.LogitsScaling, h.LogitsScaling}} {
			*m.dst = 1
			if m.src != nil {
				*m.dst = *m.src
			}
			if !(*m.dst > 0) {
				return Config{}, fmt.Errorf("config.json: GraniteMoe multipliers must be positive")
			}
		}
	}
	c.KVHeads = c.Heads
	if h.KVHeads != nil {
		c.KVHeads = *h.KVHeads
	}
	if h.NormEps != nil {
		c.NormEps = *h.NormEps
	}
	if h.RopeTheta != nil {
		c.RopeTheta = *h.RopeTheta
	}
	if r := h.RopeParameters; r != nil {
		if r.RopeType != "" && r.RopeType != "default" {
			return Config{}, fmt.Errorf("config.json: rope_type %q: only \"default\" is implemented", r.RopeType)
		}
		if r.RopeTheta != nil {
			c.RopeTheta = *r.RopeTheta
		}
	}
	if h.RouterAuxCoef != nil {
		c.RouterAuxCoef = *h.RouterAuxCoef
	}
	if h.PadTokenID != nil {
		c.PadTokenID = *h.PadTokenID
	}
	if h.HeadDim != nil && c.Heads > 0 && *h.HeadDim != c.Hidden/c.Heads {
		return Config{}, fmt.Errorf("config.json: head_dim %d: OLMoE's q_norm needs heads x head_dim = hidden_size", *h.HeadDim)
	}
	if err := c.Validate(); err != nil {
		return Config{}, fmt.Errorf("config.json: %w", err)
	}
	return c, nil
}
