package main

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/safetensors"
)

func TestReadBatch(t *testing.T) {
	cases := []struct {
		name         string
		tensors      map[string]safetensors.Tensor
		inputs, tgts []int32
		err          string
	}{
		{"labels default to the inputs, shifted within each row",
			map[string]safetensors.Tensor{"input_ids": safetensors.I64([]int{2, 3}, []int64{5, 6, 7, 8, 9, 10})},
			[]int32{5, 6, 7, 8, 9, 10}, []int32{6, 7, -1, 9, 10, -1}, ""},
		{"ignored labels",
			map[string]safetensors.Tensor{"input_ids": safetensors.I64([]int{1, 4}, []int64{1, 2, 3, 4}),
				"labels": safetensors.I64([]int{1, 4}, []int64{1, -100, 3, 4})},
			[]int32{1, 2, 3, 4}, []int32{-1, 3, 4, -1}, ""},
		{"no input_ids", map[string]safetensors.Tensor{"x": safetensors.I64([]int{1, 1}, []int64{1})}, nil, nil, "input_ids"},
		{"labels of another shape",
			map[string]safetensors.Tensor{"input_ids": safetensors.I64([]int{1, 2}, []int64{1, 2}),
				"labels": safetensors.I64([]int{2, 1}, []int64{1, 2})}, nil, nil, "shape"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "in.safetensors")
			if err := safetensors.WriteFile(path, c.tensors, nil); err != nil {
				t.Fatal(err)
			}
			in, tg, _, _, err := readBatch(path)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("error %v, want one mentioning %q", err, c.err)
				}
				return
			}
			if err != nil || !slices.Equal(in, c.inputs) || !slices.Equal(tg, c.tgts) {
				t.Errorf("got %v %v (%v), want %v %v", in, tg, err, c.inputs, c.tgts)
			}
		})
	}
}
