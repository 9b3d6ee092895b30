package model

import (
	"math"
	"slices"
	"strings"
	"testing"
)

func TestConfigValidate(t *testing.T) {
	ok := DefaultConfig()
	cases := []struct {
		name string
		edit func(*Config)
		want string // error substring, "" for none
	}{
		{"default", func(*Config) {}, ""},
		{"top-k above experts", func(c *Config) { c.TopK = c.Experts + 1 }, "top-k"},
		{"zero top-k", func(c *Config) { c.TopK = 0 }, "top-k"},
		{"no layers", func(c *Config) { c.Layers = 0 }, "layers"},
		{"vocab 1", func(c *Config) { c.Vocab = 1 }, "vocab"},
		{"no window", func(c *Config) { c.MixWindow = 0 }, "window"},
		{"eps 0", func(c *Config) { c.NormEps = 0 }, "eps"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := ok
			c.edit(&cfg)
			_, err := New(cfg, 1)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("error %v, want one mentioning %q", err, c.want)
			}
		})
	}
}

func TestModelShapesAndInitialLoss(t *testing.T) {
	cfg := DefaultConfig()
	m, err := New(cfg, 7)
	if err != nil {
		t.Fatal(err)
	}
	total, expert := m.Counts()
	e, h, in := cfg.Experts, cfg.Hidden, cfg.Intermediate
	if want := cfg.Layers * 3 * e * h * in; expert != want {
		t.Errorf("expert parameters %d, want %d", expert, want)
	}
	if total <= expert {
		t.Errorf("total %d not above expert %d", total, expert)
	}
	if got, want := m.ExpertBytes(), int64(4*3*e*h*in); got != want {
		t.Errorf("ExpertBytes %d, want %d", got, want)
	}
	names := map[string]bool{}
	for _, p := range m.Params() {
		if names[p.Name] {
			t.Errorf("duplicate parameter name %q", p.Name)
		}
		names[p.Name] = true
		if p.Expert != strings.Contains(p.Name, ".experts.") || p.Expert != (p.G == nil) {
			t.Errorf("%s: Expert %v, G %v", p.Name, p.Expert, p.G != nil)
		}
	}
	pass, err := m.NewPass(2, 16)
	if err != nil {
		t.Fatal(err)
	}
	in32 := make([]int32, 32)
	for i := range in32 {
		in32[i] = int32('a' + i%26)
	}
	loss, err := pass.Forward(in32, in32)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(loss-math.Log(256)) > 0.2 {
		t.Errorf("initial loss %.3f, want about ln 256 = %.3f", loss, math.Log(256))
	}
	if _, err := pass.Forward(in32[:5], in32[:5]); err == nil {
		t.Error("Forward accepted a batch of the wrong size")
	}
	bad := slices.Clone(in32)
	bad[3] = 300
	if _, err := pass.Forward(bad, in32); err == nil {
		t.Error("Forward accepted a token outside the vocabulary")
	}
}
