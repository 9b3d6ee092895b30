package hfmoe

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/sonar-moe/sonar/safetensors"
)

// Checkpoint is what Load read besides the weights: the directory and its
// config.json as a generic JSON object, kept to write it back.
type Checkpoint struct {
	Dir    string
	Config map[string]any
}

// Load reads a save_pretrained directory of an OlmoeForCausalLM:
// config.json and model.safetensors, or the shards that
// model.safetensors.index.json names. Weights of any float dtype (F32, BF16,
// F16, F64) are converted to F. Expert weights may be stored per expert, as
// transformers 5.x saves them and as the Hub's OLMoE checkpoints are
// ("model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight"), or batched
// as the v5 module holds them ("...mlp.experts.gate_up_proj", [E, 2I, H];
// "...mlp.experts.down_proj", [E, H, I]). A missing or unexpected tensor is
// an error (a stored rotary_emb.inv_freq buffer is ignored).
func Load[F Float](dir string) (*Model[F], *Checkpoint, error) {
	cb, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, nil, fmt.Errorf("hfmoe load: %w", err)
	}
	cfg, err := ParseHFConfig(cb)
	if err != nil {
		return nil, nil, fmt.Errorf("hfmoe load %s: %w", dir, err)
	}
	ck := &Checkpoint{Dir: dir}
	if err := json.Unmarshal(cb, &ck.Config); err != nil {
		return nil, nil, fmt.Errorf("hfmoe load: config.json: %w", err)
	}
	tensors, err := readTensors(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("hfmoe load: %w", err)
	}
	m, err := New[F](cfg)
	if err != nil {
		return nil, nil, err
	}
	used := map[string]bool{}
	take := func(name string, shape []int) ([]float32, error) {
		t, ok := tensors[name]
		if !ok {
			return nil, fmt.Errorf("tensor %s is missing", name)
		}
		if !equalShape(t.Shape, shape) {
			return nil, fmt.Errorf("tensor %s: shape %v, want %v", name, t.Shape, shape)
		}
		used[name] = true
		v, err := t.Float32s()
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", name, err)
		}
		return v, nil
	}
	for l, ly := range m.Layers {
		if err := loadExperts(m, l, ly, tensors, take); err != nil {
			return nil, nil, fmt.Errorf("hfmoe load %s: %w", dir, err)
		}
	}
	for _, p := range m.params {
		if p.Expert {
			continue
		}
		name := p.Name
		if stored := storedName(cfg, p.Name); stored != name {
			if _, ok := tensors[name]; !ok {
				name = stored
			}
		}
		v, err := take(name, p.Shape)
		if err != nil {
			return nil, nil, fmt.Errorf("hfmoe load %s: %w", dir, err)
		}
		for i, x := range v {
			p.W[i] = F(x)
		}
	}
	if cfg.TieEmbeddings {
		used["lm_head.weight"] = true // transformers may store the tied copy
	}
	var extra []string
	for name := range tensors {
		// Older checkpoints may carry the rotary embedding's buffer, which
		// transformers recomputes and ignores on load, as the Go model does.
		if !used[name] && !strings.HasSuffix(name, "rotary_emb.inv_freq") {
			extra = append(extra, name)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		return nil, nil, fmt.Errorf("hfmoe load %s: %d unexpected tensors: %s", dir, len(extra), strings.Join(extra[:min(len(extra), 5)], ", "))
	}
	return m, ck, nil
}

func loadExperts[F Float](m *Model[F], l int, ly Layer[F], tensors map[string]safetensors.Tensor, take func(string, []int) ([]float32, error)) error {
	c := m.Cfg
	e, in, h := c.Experts, c.Intermediate, c.Hidden
	_, batched := tensors[ly.GateUp.Name]
	if c.Arch == ArchGraniteMoE || batched {
		for _, p := range []*Param[F]{ly.GateUp, ly.Down} {
			name := p.Name
			if !batched {
				name = storedName(c, name)
			}
			v, err := take(name, p.Shape)
			if err != nil {
				return err
			}
			for i, x := range v {
				p.W[i] = F(x)
			}
		}
		return nil
	}
	for x := range e {
		pre := fmt.Sprintf("model.layers.%d.mlp.experts.%d.", l, x)
		gate, err := take(pre+"gate_proj.weight", []int{in, h})
		if err != nil {
			return err
		}
		up, err := take(pre+"up_proj.weight", []int{in, h})
		if err != nil {
			return err
		}
		down, err := take(pre+"down_proj.weight", []int{h, in})
		if err != nil {
			return err
		}
		gu := ly.GateUp.W[x*2*in*h : (x+1)*2*in*h]
		for i, v := range gate {
			gu[i] = F(v)
		}
		for i, v := range up {
			gu[in*h+i] = F(v)
		}
		dn := ly.Down.W[x*h*in : (x+1)*h*in]
		for i, v := range down {
			dn[i] = F(v)
		}
	}
	return nil
}

func equalShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// storedName is the name transformers' save_pretrained gives the parameter
// named name in the model: GraniteMoe checkpoints keep the names of its
// original modules (router.layer, input_linear, output_linear), which
// transformers 5.x renames on load. OLMoE's dense tensors keep their names
// (its experts are stored per expert, see Save).
func storedName(c Config, name string) string {
	if c.Arch != ArchGraniteMoE {
		return name
	}
	for _, r := range [...][2]string{
		{"block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"},
		{"block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"},
		{"block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"},
	} {
		if strings.HasSuffix(name, r[0]) {
			return strings.TrimSuffix(name, r[0]) + r[1]
		}
	}
	return name
}

// readTensors reads model.safetensors, or every shard the index names.
func readTensors(dir string) (map[string]safetensors.Tensor, error) {
	ib, err := os.ReadFile(filepath.Join(dir, "model.safetensors.index.json"))
	if errors.Is(err, fs.ErrNotExist) {
		f, err := safetensors.ReadFile(filepath.Join(dir, "model.safetensors"))
		if err != nil {
			return nil, err
		}
		return f.Tensors, nil
	}
	if err != nil {
		return nil, err
	}
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(ib, &index); err != nil {
		return nil, fmt.Errorf("model.safetensors.index.json: %w", err)
	}
	shards := map[string]bool{}
	for _, f := range index.WeightMap {
		if f != filepath.Base(f) {
			return nil, fmt.Errorf("model.safetensors.index.json: shard %q is not a file name", f)
		}
		shards[f] = true
	}
	out := map[string]safetensors.Tensor{}
	for s := range shards {
		f, err := safetensors.ReadFile(filepath.Join(dir, s))
		if err != nil {
			return nil, err
		}
		for name, t := range f.Tensors {
			if want, ok := index.WeightMap[name]; !ok || want != s {
				return nil, fmt.Errorf("tensor %s is in shard %s but the index says %q", name, s, want)
			}
			out[name] = t
		}
	}
	for name := range index.WeightMap {
		if _, ok := out[name]; !ok {
			return nil, fmt.Errorf("tensor %s: named by the index, absent from its shard", name)
		}
	}
	return out, nil
}

// SaveOptions choose how Save writes a checkpoint.
type SaveOptions struct {
	// BF16 stores the weights as bfloat16 (rounded to nearest even);
	// otherwise float32.
	BF16 bool
	// CopyFrom, when set, is a directory whose other files (tokenizer,
	// generation_config.json, ...) are copied along; its config.json and
	// weights are not.
	CopyFrom string
}

// Save writes m as a save_pretrained directory that transformers'
// AutoModelForCausalLM.from_pretrained loads: config.json (the given JSON
// object, or one built from m.Cfg when nil, with its dtype updated) and
// model.safetensors in the layout transformers 5.x itself writes (and
// converts to its batched expert tensors on load): OLMoE experts per expert,
// GraniteMoe experts batched under their original module names. A tied
// lm_head is not stored, as transformers does not store it.
func Save[F Float](dir string, m *Model[F], config map[string]any, o SaveOptions) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("hfmoe save: %w", err)
	}
	if o.CopyFrom != "" {
		if err := copyExtras(o.CopyFrom, dir); err != nil {
			return fmt.Errorf("hfmoe save: %w", err)
		}
	}
	if config == nil {
		config = m.Cfg.hfJSON()
	} else {
		cp := make(map[string]any, len(config))
		for k, v := range config {
			cp[k] = v
		}
		config = cp
	}
	delete(config, "torch_dtype")
	config["dtype"] = "float32"
	if o.BF16 {
		config["dtype"] = "bfloat16"
	}
	cb, err := json.MarshalIndent(config, "", "  ")
	if err != nil {
		return fmt.Errorf("hfmoe save: config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), append(cb, '\n'), 0o644); err != nil {
		return fmt.Errorf("hfmoe save: %w", err)
	}
	mk := func(shape []int, v []F) safetensors.Tensor {
		f := make([]float32, len(v))
		for i, x := range v {
			f[i] = float32(x)
		}
		if o.BF16 {
			return safetensors.BF16(shape, f)
		}
		return safetensors.F32(shape, f)
	}
	c := m.Cfg
	e, in, h := c.Experts, c.Intermediate, c.Hidden
	out := map[string]safetensors.Tensor{}
	for _, p := range m.params {
		if !p.Expert || c.Arch == ArchGraniteMoE {
			out[storedName(c, p.Name)] = mk(p.Shape, p.W)
		}
	}
	for l, ly := range m.Layers {
		if c.Arch == ArchGraniteMoE {
			break // batched, stored above
		}
		for x := range e {
			pre := fmt.Sprintf("model.layers.%d.mlp.experts.%d.", l, x)
			gu := ly.GateUp.W[x*2*in*h : (x+1)*2*in*h]
			out[pre+"gate_proj.weight"] = mk([]int{in, h}, gu[:in*h])
			out[pre+"up_proj.weight"] = mk([]int{in, h}, gu[in*h:])
			out[pre+"down_proj.weight"] = mk([]int{h, in}, ly.Down.W[x*h*in:(x+1)*h*in])
		}
	}
	os.Remove(filepath.Join(dir, "model.safetensors.index.json")) // a stale index would win over the file
	if err := safetensors.WriteFile(filepath.Join(dir, "model.safetensors"), out, map[string]string{"format": "pt"}); err != nil {
		return fmt.Errorf("hfmoe save: %w", err)
	}
	return nil
}

// copyExtras copies the regular files of src other than config.json and
// weights into dst.
func copyExtras(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		n := e.Name()
		if !e.Type().IsRegular() || n == "config.json" || strings.HasSuffix(n, ".safetensors") ||
			n == "model.safetensors.index.json" || strings.HasSuffix(n, ".bin") || strings.HasSuffix(n, ".pt") {
			continue
		}
		if err := copyFile(filepath.Join(src, n), filepath.Join(dst, n)); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// hfJSON is an OlmoeConfig JSON object for c.
func (c Config) hfJSON() map[string]any {
	pad := any(nil)
	if c.PadTokenID >= 0 {
		pad = c.PadTokenID
	}
	if c.Arch == ArchGraniteMoE {
		return map[string]any{
			"architectures":        []string{"GraniteMoeForCausalLM"},
			"model_type":           ArchGraniteMoE,
			"vocab_size":           c.Vocab,
			"hidden_size":          c.Hidden,
			"intermediate_size":    c.Intermediate,
			"num_hidden_layers":    c.Layers,
			"num_attention_heads":  c.Heads,
			"num_key_value_heads":  c.KVHeads,
			"num_local_experts":    c.Experts,
			"num_experts_per_tok":  c.TopK,
			"rms_norm_eps":         c.NormEps,
			"rope_parameters":      map[string]any{"rope_type": "default", "rope_theta": c.RopeTheta},
			"output_router_logits": c.AuxLoss,
			"router_aux_loss_coef": c.RouterAuxCoef,
			"tie_word_embeddings":  c.TieEmbeddings,
			"pad_token_id":         pad,
			"hidden_act":           "silu",
			"attention_bias":       false,
			"embedding_multiplier": orOne(c.EmbeddingMultiplier),
			"residual_multiplier":  orOne(c.ResidualMultiplier),
			"attention_multiplier": c.attnScale(),
			"logits_scaling":       orOne(c.LogitsScaling),
		}
	}
	return map[string]any{
		"architectures":        []string{"OlmoeForCausalLM"},
		"model_type":           "olmoe",
		"vocab_size":           c.Vocab,
		"hidden_size":          c.Hidden,
		"intermediate_size":    c.Intermediate,
		"num_hidden_layers":    c.Layers,
		"num_attention_heads":  c.Heads,
		"num_key_value_heads":  c.KVHeads,
		"num_experts":          c.Experts,
		"num_experts_per_tok":  c.TopK,
		"rms_norm_eps":         c.NormEps,
		"rope_parameters":      map[string]any{"rope_type": "default", "rope_theta": c.RopeTheta},
		"norm_topk_prob":       c.NormTopKProb,
		"output_router_logits": c.AuxLoss,
		"router_aux_loss_coef": c.RouterAuxCoef,
		"tie_word_embeddings":  c.TieEmbeddings,
		"pad_token_id":         pad,
		"hidden_act":           "silu",
		"attention_bias":       false,
		"clip_qkv":             nil,
	}
}

// attnScale is the attention's scale: attention_multiplier, or head_dim^-0.5.
func (c Config) attnScale() float64 {
	if c.AttentionMultiplier != 0 {
		return c.AttentionMultiplier
	}
	return math.Pow(float64(c.HeadDim()), -0.5)
}
