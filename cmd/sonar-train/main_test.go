package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

func TestFlagErrors(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"zero steps", []string{"--steps", "0"}, "--steps"},
		{"top-k above experts", []string{"--experts", "2", "--top-k", "3"}, "top-k"},
		{"both modes", []string{"--keep-all-grads", "--compare"}, "choose one"},
		{"bad progress", []string{"--progress", "maybe"}, "--progress"},
		{"stray argument", []string{"extra"}, "unexpected"},
		{"unknown flag", []string{"--nope"}, "nope"},
		{"bad log level", []string{"--log-level", "loud"}, "--log-level"},
		{"hf without tokens", []string{"--hf", "x"}, "--tokens"},
		{"tokens without hf", []string{"--tokens", "x"}, "go with --hf"},
		{"hf with data", []string{"--hf", "x", "--tokens", "y", "--data", "z"}, "not --data"},
		{"bad sample", []string{"--hf", "x", "--tokens", "y", "--sample", "shuffled"}, "--sample"},
		{"sample without hf", []string{"--sample", "sequential"}, "goes with --hf"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(c.args, &out, &errb); code != exitUsage {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, exitUsage, errb.String())
			}
			if !strings.Contains(errb.String(), c.want) {
				t.Errorf("stderr does not mention %q:\n%s", c.want, errb.String())
			}
		})
	}
}

// A short run of both modes on a small text: the loss falls, the
// parameters agree bit for bit, and per-layer updates hold one layer of
// expert gradients where the baseline holds all.
func TestTrainCompare(t *testing.T) {
	dir := t.TempDir()
	text := strings.Repeat("package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, world\")\n}\n", 300)
	if err := os.WriteFile(filepath.Join(dir, "a.go"), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	args := []string{"--data", dir, "--steps", "40", "--layers", "2", "--experts", "4", "--hidden", "16",
		"--intermediate", "24", "--seq-len", "32", "--batch", "4", "--lr", "1e-2", "--warmup", "4", "--eval-batches", "2",
		"--log-level", "warn", "--progress", "on"}
	if code := run(args, &out, &errb); code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s", code, errb.String())
	}
	s := out.String()
	for _, want := range []string{"params bitwise equal: yes", "| per-layer updates in backward (sonar) |", "| keep all expert grads (standard) |",
		"(1 layer)", "(2 layers)"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
	m := regexp.MustCompile(`\| per-layer[^|]*\| ([0-9.]+) -> ([0-9.]+) \|`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("no loss in the table:\n%s", s)
	}
	first, _ := strconv.ParseFloat(m[1], 64)
	last, _ := strconv.ParseFloat(m[2], 64)
	if !(first > 5 && last < 3.5) {
		t.Errorf("loss %v -> %v, want from about 5.5 to below 3.5", first, last)
	}
	if !strings.Contains(errb.String(), "steps/s") {
		t.Errorf("no progress line on stderr:\n%s", errb.String())
	}
}
