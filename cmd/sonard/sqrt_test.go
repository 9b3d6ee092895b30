package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// torchLib is the repository venv's libtorch_cpu.so ($SONAR_TORCH_LIB
// first); the test skips without one.
func torchLib(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SONAR_TORCH_LIB"); p != "" {
		return p
	}
	p, err := filepath.Abs("../../.venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skipf("no libtorch_cpu.so (set SONAR_TORCH_LIB or create the venv): %v", err)
	}
	return p
}

// TestSqrtLoader: --mkl-sqrt auto uses an emulation where one checks equal
// (and logs which), call never does; a library is loaded and checked once;
// a missing one is an error.
func TestSqrtLoader(t *testing.T) {
	lib := torchLib(t)
	for _, emulate := range []bool{true, false} {
		core, logs := observer.New(zap.InfoLevel)
		l := &sqrtLoader{log: zap.New(core), emulate: emulate, workers: 2}
		q, name, err := l.load(lib)
		if err != nil {
			t.Fatal(err)
		}
		if name != "mkl:"+lib {
			t.Errorf("name %q", name)
		}
		entries := logs.All()
		switch {
		case !emulate && q.IsMKLEmulation():
			t.Errorf("--mkl-sqrt call: %v", q)
		case !emulate && len(entries) != 0:
			t.Errorf("--mkl-sqrt call logged %q", entries[0].Message)
		case emulate && len(entries) != 1:
			t.Fatalf("auto: %d log entries, want 1", len(entries))
		case emulate && q.IsMKLEmulation() != strings.Contains(entries[0].Message, "emulated"):
			t.Errorf("auto: %v, logged %q", q, entries[0].Message)
		}
		if emulate {
			t.Logf("%s: %v", entries[0].Message, entries[0].ContextMap())
		}
		if _, _, err := l.load(lib); err != nil || len(logs.All()) != len(entries) {
			t.Errorf("second load: %v, %d log entries (want it remembered)", err, len(logs.All()))
		}
	}
	l := &sqrtLoader{log: zap.NewNop(), emulate: true, workers: 1}
	if _, _, err := l.load(filepath.Join(t.TempDir(), "missing.so")); err == nil {
		t.Error("a missing library loaded")
	}
}
