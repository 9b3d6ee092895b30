package hfmoe

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/safetensors"
)

func TestSaveLoadRoundTrip(t *testing.T) {
	for _, tied := range []bool{false, true} {
		cfg := tinyConfig()
		cfg.TieEmbeddings = tied
		m, err := New[float32](cfg)
		if err != nil {
			t.Fatal(err)
		}
		m.Init(1, 0.3)
		dir := t.TempDir()
		if err := Save(dir, m, nil, SaveOptions{}); err != nil {
			t.Fatal(err)
		}
		f, err := safetensors.ReadFile(filepath.Join(dir, "model.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := f.Tensors["lm_head.weight"]; ok == tied {
			t.Errorf("tied=%v: lm_head.weight stored: %v", tied, ok)
		}
		if _, ok := f.Tensors["model.layers.1.mlp.experts.3.up_proj.weight"]; !ok {
			t.Errorf("no per-expert key in %v", f.Names())
		}
		back, ck, err := Load[float32](dir)
		if err != nil {
			t.Fatal(err)
		}
		if back.Cfg != cfg || ck.Config["model_type"] != "olmoe" {
			t.Errorf("config back %+v, want %+v", back.Cfg, cfg)
		}
		for i, p := range m.Params() {
			if !slices.Equal(p.W, back.Params()[i].W) {
				t.Errorf("tied=%v: %s differs after the round trip", tied, p.Name)
			}
		}
		// bfloat16: every weight back as its bfloat16 rounding.
		if err := Save(dir, m, ck.Config, SaveOptions{BF16: true}); err != nil {
			t.Fatal(err)
		}
		b16, _, err := Load[float32](dir)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := safetensors.BF16([]int{len(m.Embed.W)}, m.Embed.W).Float32s()
		if !slices.Equal(b16.Embed.W, want) {
			t.Error("bf16 embedding is not the bf16 rounding of the original")
		}
	}
}

func TestLoadBatchedExperts(t *testing.T) {
	m, err := New[float32](tinyConfig())
	if err != nil {
		t.Fatal(err)
	}
	m.Init(2, 0.3)
	dir := t.TempDir()
	if err := Save(dir, m, nil, SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	ts := map[string]safetensors.Tensor{}
	for _, p := range m.Params() {
		ts[p.Name] = safetensors.F32(p.Shape, p.W)
	}
	if err := safetensors.WriteFile(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	back, _, err := Load[float32](dir)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range m.Params() {
		if !slices.Equal(p.W, back.Params()[i].W) {
			t.Errorf("%s differs", p.Name)
		}
	}
}

func TestLoadRejects(t *testing.T) {
	m, err := New[float32](tinyConfig())
	if err != nil {
		t.Fatal(err)
	}
	base := map[string]safetensors.Tensor{}
	for _, p := range m.Params() {
		base[p.Name] = safetensors.F32(p.Shape, p.W)
	}
	cases := []struct {
		name string
		edit func(map[string]safetensors.Tensor)
		want string
	}{
		{"missing", func(ts map[string]safetensors.Tensor) { delete(ts, "model.norm.weight") }, "model.norm.weight is missing"},
		{"unexpected", func(ts map[string]safetensors.Tensor) { ts["extra.bias"] = safetensors.F32([]int{1}, []float32{1}) }, "unexpected tensors: extra.bias"},
		{"shape", func(ts map[string]safetensors.Tensor) {
			ts["lm_head.weight"] = safetensors.F32([]int{2}, []float32{1, 2})
		}, "shape [2]"},
		{"inv_freq ignored, extra reported", func(ts map[string]safetensors.Tensor) {
			ts["model.layers.0.self_attn.rotary_emb.inv_freq"] = safetensors.F32([]int{1}, []float32{1})
			ts["model.zzz"] = safetensors.F32([]int{1}, []float32{1})
		}, "1 unexpected tensors: model.zzz"},
		{"dtype", func(ts map[string]safetensors.Tensor) {
			ts["model.norm.weight"] = safetensors.I64([]int{8}, make([]int64, 8))
		}, "not a float"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := Save(dir, m, nil, SaveOptions{}); err != nil {
				t.Fatal(err)
			}
			ts := map[string]safetensors.Tensor{}
			for k, v := range base {
				ts[k] = v
			}
			c.edit(ts)
			if err := safetensors.WriteFile(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
				t.Fatal(err)
			}
			_, _, err := Load[float32](dir)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one mentioning %q", err, c.want)
			}
		})
	}
}

func TestParseHFConfig(t *testing.T) {
	const ok = `"model_type":"olmoe","vocab_size":50,"hidden_size":16,"intermediate_size":8,"num_hidden_layers":2,` +
		`"num_attention_heads":4,"num_experts":4,"num_experts_per_tok":2`
	c, err := ParseHFConfig([]byte(`{` + ok + `}`))
	if err != nil {
		t.Fatal(err)
	}
	// OlmoeConfig's defaults for what is absent.
	if c.KVHeads != 4 || c.NormEps != 1e-5 || c.RopeTheta != 10000 || c.RouterAuxCoef != 0.01 || c.PadTokenID != -1 || c.AuxLoss || c.NormTopKProb {
		t.Errorf("defaults: %+v", c)
	}
	c, err = ParseHFConfig([]byte(`{` + ok + `,"rope_theta":500000,"rope_parameters":{"rope_type":"default","rope_theta":20000},"pad_token_id":1,"output_router_logits":true}`))
	if err != nil || c.RopeTheta != 20000 || c.PadTokenID != 1 || !c.AuxLoss {
		t.Errorf("%+v %v", c, err)
	}
	for _, bad := range []struct{ extra, want string }{
		{`,"model_type":"mixtral"`, "model_type"},
		{`,"clip_qkv":8`, "clip_qkv"},
		{`,"attention_bias":true`, "attention_bias"},
		{`,"hidden_act":"gelu"`, "hidden_act"},
		{`,"rope_parameters":{"rope_type":"yarn"}`, "rope_type"},
		{`,"rope_scaling":{"type":"linear"}`, "rope_scaling"},
		{`,"num_key_value_heads":3`, "num_key_value_heads"},
		{`,"num_experts_per_tok":5`, "num_experts_per_tok"},
		{`,"head_dim":8`, "head_dim"},
		{`,"pad_token_id":50`, "pad_token_id"},
	} {
		if _, err := ParseHFConfig([]byte(`{` + ok + bad.extra + `}`)); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: error %v, want one mentioning %q", bad.extra, err, bad.want)
		}
	}
}

func TestSaveCopiesTokenizerFiles(t *testing.T) {
	m, err := New[float32](tinyConfig())
	if err != nil {
		t.Fatal(err)
	}
	src, dst := t.TempDir(), t.TempDir()
	for _, n := range []string{"tokenizer.json", "generation_config.json", "model.safetensors", "config.json"} {
		if err := os.WriteFile(filepath.Join(src, n), []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := Save(dst, m, nil, SaveOptions{CopyFrom: src}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"tokenizer.json", "generation_config.json"} {
		if _, err := os.Stat(filepath.Join(dst, n)); err != nil {
			t.Errorf("%s not copied: %v", n, err)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "config.json")); string(b) == "{}" {
		t.Error("config.json was copied over the written one")
	}
}

func TestGraniteSaveLoad(t *testing.T) {
	cfg := tinyConfig()
	cfg.Arch, cfg.NormTopKProb, cfg.RouterAuxCoef = ArchGraniteMoE, true, 0.001
	cfg.EmbeddingMultiplier, cfg.ResidualMultiplier, cfg.AttentionMultiplier, cfg.LogitsScaling = 12, 0.22, 0.0078125, 6
	m, err := New[float32](cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(4, 0.3)
	dir := t.TempDir()
	if err := Save(dir, m, nil, SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	f, err := safetensors.ReadFile(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"model.layers.1.block_sparse_moe.input_linear.weight", "model.layers.1.block_sparse_moe.output_linear.weight",
		"model.layers.0.block_sparse_moe.router.layer.weight"} {
		if _, ok := f.Tensors[n]; !ok {
			t.Errorf("no %s in %v", n, f.Names())
		}
	}
	back, _, err := Load[float32](dir)
	if err != nil {
		t.Fatal(err)
	}
	if back.Cfg != cfg {
		t.Errorf("config back %+v, want %+v", back.Cfg, cfg)
	}
	for i, p := range m.Params() {
		if !slices.Equal(p.W, back.Params()[i].W) {
			t.Errorf("%s differs after the round trip", p.Name)
		}
	}
}
