package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
)

func writeSpec(t *testing.T, sp any) string {
	t.Helper()
	dir := t.TempDir()
	b, err := json.Marshal(sp)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "spec.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestReadSpec(t *testing.T) {
	sc := ScalarsJSON{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001,
		NegStepSize: -0.001, BC2Sqrt: 0.0316, Eps: 1e-8}
	ams := sc
	ams.Amsgrad = true
	tests := []struct {
		name string
		spec Spec
		err  string
	}{
		{"good", Spec{DType: "bfloat16", Steps: 2, Tensors: []SpecTensor{{Numel: 5}, {Numel: 7, Amsgrad: true}},
			Scalars: [][]ScalarsJSON{{sc, ams}, {sc, ams}}}, ""},
		{"bad dtype", Spec{DType: "float16", Steps: 1, Tensors: []SpecTensor{{Numel: 5}}, Scalars: [][]ScalarsJSON{{sc}}}, "unsupported dtype"},
		{"steps and scalars disagree", Spec{DType: "float32", Steps: 2, Tensors: []SpecTensor{{Numel: 5}}, Scalars: [][]ScalarsJSON{{sc}}}, "2 steps, 1 scalar sets"},
		{"scalars per tensor", Spec{DType: "float32", Steps: 1, Tensors: []SpecTensor{{Numel: 5}, {Numel: 1}}, Scalars: [][]ScalarsJSON{{sc}}}, "scalars for 1 of 2"},
		{"amsgrad mismatch", Spec{DType: "float32", Steps: 1, Tensors: []SpecTensor{{Numel: 5}}, Scalars: [][]ScalarsJSON{{ams}}}, "amsgrad differs"},
		{"zero numel", Spec{DType: "float32", Steps: 1, Tensors: []SpecTensor{{Numel: 0}}, Scalars: [][]ScalarsJSON{{sc}}}, "numel 0"},
		{"no tensors", Spec{DType: "float32", Steps: 1, Scalars: [][]ScalarsJSON{{}}}, "0 tensors"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, dt, err := readSpec(writeSpec(t, tc.spec))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || dt.String() != "bfloat16" {
				t.Fatalf("readSpec: %v %v", dt, err)
			}
		})
	}
	if _, _, err := readSpec(t.TempDir()); err == nil {
		t.Error("missing spec.json accepted")
	}
}

func TestScalarsJSONNames(t *testing.T) {
	// The JSON names are the protocol's (docs/protocol.md), so the Python side
	// can send the same dict it sends to sonard.
	var s ScalarsJSON
	in := `{"decay":0.5,"apply_decay":true,"beta1_w":0.1,"beta2":0.9,"one_minus_beta2":0.1,"neg_step_size":-1e-3,"bc2_sqrt":0.3,"eps":1e-8,"amsgrad":true,"maximize":true}`
	if err := json.Unmarshal([]byte(in), &s); err != nil {
		t.Fatal(err)
	}
	o := s.scalars()
	if o.Decay != 0.5 || !o.ApplyDecay || o.Beta1W != 0.1 || o.Beta2 != 0.9 || o.OneMinusB2 != 0.1 || o.NegStepSize != -1e-3 ||
		o.BC2Sqrt != 0.3 || o.Eps != 1e-8 || !o.Amsgrad || !o.Maximize {
		t.Errorf("scalars %+v", o)
	}
}

// TestWithoutGPU: every GPU mode fails cleanly, naming the missing driver.
func TestWithoutGPU(t *testing.T) {
	if _, err := cuda.Open(); err == nil {
		t.Skip("this machine has a CUDA driver")
	}
	for name, run := range map[string]func() error{
		"info": info,
		"files": func() error {
			return files([]string{writeSpec(t, Spec{DType: "float32", Steps: 1, Tensors: []SpecTensor{{Numel: 1}}, Scalars: [][]ScalarsJSON{{{}}}})})
		},
		"files -loads scalar": func() error {
			return files([]string{"-loads", "scalar", writeSpec(t, Spec{DType: "float32", Steps: 1, Tensors: []SpecTensor{{Numel: 1}}, Scalars: [][]ScalarsJSON{{{}}}})})
		},
		"bench":               func() error { return bench([]string{"-numel", "8"}) },
		"bench -loads scalar": func() error { return bench([]string{"-numel", "8", "-loads", "scalar"}) },
	} {
		if err := run(); !errors.Is(err, cuda.ErrNoDriver) {
			t.Errorf("%s: err = %v, want ErrNoDriver", name, err)
		}
	}
}

// TestReferenceFollowsFused checks that fused scalars select the fused CUDA
// reference (with the given bias corrections) and others the foreach one.
func TestReferenceFollowsFused(t *testing.T) {
	const n = 64
	mk := func() (p, g, m, v []byte) {
		p, g, m, v = make([]byte, 4*n), make([]byte, 4*n), make([]byte, 4*n), make([]byte, 4*n)
		for i := 0; i < n; i++ {
			binary.LittleEndian.PutUint32(p[4*i:], math.Float32bits(float32(i)*0.01-0.3))
			binary.LittleEndian.PutUint32(g[4*i:], math.Float32bits(float32(i%7)*1e-3-2e-3))
		}
		return
	}
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	sc := optimizer.ScalarsFor(h, 2)
	sj := ScalarsJSON{Decay: sc.Decay, ApplyDecay: true, Beta1W: sc.Beta1W, Beta2: sc.Beta2, OneMinusB2: sc.OneMinusB2,
		NegStepSize: sc.NegStepSize, BC2Sqrt: sc.BC2Sqrt, Eps: sc.Eps}
	p1, g, m1, v1 := mk()
	if err := sj.reference(optimizer.Float32, 2, p1, g, m1, v1, nil); err != nil {
		t.Fatal(err)
	}
	p2, _, m2, v2 := mk()
	if err := optimizer.ForeachStep(optimizer.Float32, p2, g, m2, v2, nil, sc); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p1, p2) || !bytes.Equal(m1, m2) || !bytes.Equal(v1, v2) {
		t.Error("foreach scalars: reference is not optimizer.ForeachStep")
	}
	sj.Fused, sj.LR, sj.Beta1, sj.WeightDecay, sj.BC1, sj.BC2 = true, h.LR, h.Beta1, h.WeightDecay, 0.19, 0.002
	p1, g, m1, v1 = mk()
	if err := sj.reference(optimizer.Float32, 2, p1, g, m1, v1, nil); err != nil {
		t.Fatal(err)
	}
	k := optimizer.FusedCUDAOf(sj.scalars(), 2)
	k.BC1, k.BC2 = 0.19, 0.002
	p2, _, m2, v2 = mk()
	if err := optimizer.FusedCUDAStep(optimizer.Float32, p2, g, m2, v2, nil, k); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p1, p2) || !bytes.Equal(m1, m2) || !bytes.Equal(v1, v2) {
		t.Error("fused scalars: reference is not optimizer.FusedCUDAStep with the given bias corrections")
	}
	sj.FusedDouble = true
	p1, g, m1, v1 = mk()
	if err := sj.reference(optimizer.Float32, 2, p1, g, m1, v1, nil); err != nil {
		t.Fatal(err)
	}
	k64 := optimizer.FusedCUDA64Of(sj.scalars(), 2)
	k64.BC1, k64.BC2 = 0.19, 0.002
	p2, _, m2, v2 = mk()
	if err := optimizer.FusedCUDA64Step(optimizer.Float32, p2, g, m2, v2, nil, k64); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p1, p2) || !bytes.Equal(m1, m2) || !bytes.Equal(v1, v2) {
		t.Error("fused double scalars: reference is not optimizer.FusedCUDA64Step with the given bias corrections")
	}
}

// TestBadLoads: a -loads that is neither vector nor scalar (nor both, for
// bench) is refused before any device is opened.
func TestBadLoads(t *testing.T) {
	if err := files([]string{"-loads", "wide", t.TempDir()}); err == nil || !strings.Contains(err.Error(), "want vector or scalar") {
		t.Errorf("files: err = %v", err)
	}
	if err := bench([]string{"-loads", "wide"}); err == nil || !strings.Contains(err.Error(), "want vector or scalar") {
		t.Errorf("bench: err = %v", err)
	}
	if err := files([]string{}); err == nil || !strings.Contains(err.Error(), "usage") {
		t.Errorf("files without DIR: err = %v", err)
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		in := append([]float64(nil), tc.in...)
		if got := median(in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		for i := range in {
			if in[i] != tc.in[i] {
				t.Errorf("median reordered its input: %v", in)
			}
		}
	}
}
