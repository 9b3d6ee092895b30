package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/train/hfmoe"
)

// --hf end to end in Go: a tiny checkpoint, token ids in a text file, both
// modes bit-equal, and the saved checkpoint loads with changed weights.
func TestTrainHF(t *testing.T) {
	dir := t.TempDir()
	cfg := hfmoe.Config{Vocab: 40, Hidden: 16, Intermediate: 8, Layers: 2, Heads: 4, KVHeads: 2, Experts: 4, TopK: 2,
		NormEps: 1e-5, RopeTheta: 10000, RouterAuxCoef: 0.01, PadTokenID: -1}
	m, err := hfmoe.New[float32](cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(1, 0.1)
	ck := filepath.Join(dir, "ck")
	if err := hfmoe.Save(ck, m, nil, hfmoe.SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	var ids strings.Builder
	for i := range 2000 {
		fmt.Fprintf(&ids, "%d ", (i*7)%40)
	}
	tokens := filepath.Join(dir, "ids.txt")
	if err := os.WriteFile(tokens, []byte(ids.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	var stdout, stderr bytes.Buffer
	args := []string{"--hf", ck, "--tokens", tokens, "--out", out, "--compare", "--steps", "20", "--batch", "2", "--seq-len", "12",
		"--lr", "1e-2", "--warmup", "2", "--eval-batches", "2", "--log-level", "warn", "--progress", "off"}
	if code := run(args, &stdout, &stderr); code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr.String())
	}
	if s := stdout.String(); !strings.Contains(s, "params bitwise equal: yes") || !strings.Contains(s, "(1 layer)") {
		t.Errorf("output:\n%s", s)
	}
	back, _, err := hfmoe.Load[float32](out)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Equal(back.Layers[0].GateUp.W, m.Layers[0].GateUp.W) || slices.Equal(back.Embed.W, m.Embed.W) {
		t.Error("the saved checkpoint has the original weights")
	}
	// A token outside the vocabulary is refused before training.
	if err := os.WriteFile(tokens, []byte("1 2 3 99 "+ids.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	stderr.Reset()
	if code := run(args, &stdout, &stderr); code != exitError || !strings.Contains(stderr.String(), "outside the vocabulary") {
		t.Errorf("exit %d, stderr:\n%s", code, stderr.String())
	}
}

// Sequential windows: seq apart from the start, wrapping once no whole
// window of seq+1 tokens is left; targets are the inputs shifted by one.
func TestTokenSamplerSequential(t *testing.T) {
	toks := make([]int32, 23)
	for i := range toks {
		toks[i] = int32(i)
	}
	s, err := newTokenSampler(toks, 5, 1)
	if err != nil {
		t.Fatal(err)
	}
	s.sequential = true
	in, tgt := make([]int32, 10), make([]int32, 10)
	var starts []int32
	for range 3 {
		s.Batch(in, tgt)
		starts = append(starts, in[0], in[5])
		for i := range in {
			if tgt[i] != in[i]+1 {
				t.Fatalf("target %d after input %d", tgt[i], in[i])
			}
		}
	}
	// (23-1)/5 = 4 windows: 0, 5, 10, 15 (15..20 fits; 20..25 does not).
	if want := []int32{0, 5, 10, 15, 0, 5}; !slices.Equal(starts, want) {
		t.Errorf("window starts %v, want %v", starts, want)
	}
}
