package safetensors

import (
	"bytes"
	"encoding/binary"
	"math"
	"path/filepath"
	"strings"
	"testing"
)

func TestRoundTrip(t *testing.T) {
	f32 := []float32{0, -1.5, 3.25, float32(math.Inf(1)), 1e-40}
	in := map[string]Tensor{
		"a.weight": F32([]int{5}, f32),
		"b":        BF16([]int{1, 5}, f32),
		"ids":      I64([]int{2, 2}, []int64{0, -100, 7, 1 << 40}),
		"scalar":   F64([]int{1}, []float64{math.Pi}),
	}
	path := filepath.Join(t.TempDir(), "x.safetensors")
	if err := WriteFile(path, in, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	f, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if f.Metadata["format"] != "pt" || strings.Join(f.Names(), ",") != "a.weight,b,ids,scalar" {
		t.Fatalf("metadata %v, names %v", f.Metadata, f.Names())
	}
	for name, want := range in {
		got := f.Tensors[name]
		if got.DType != want.DType || !bytes.Equal(got.Data, want.Data) || len(got.Shape) != len(want.Shape) {
			t.Errorf("%s: got %+v, want %+v", name, got, want)
		}
	}
	v, err := f.Tensors["a.weight"].Float32s()
	if err != nil || v[2] != 3.25 || v[4] != 1e-40 {
		t.Errorf("F32 back: %v %v", v, err)
	}
	ids, err := f.Tensors["ids"].Int64s()
	if err != nil || ids[1] != -100 || ids[3] != 1<<40 {
		t.Errorf("I64 back: %v %v", ids, err)
	}
	// The data starts 8-byte aligned, as the reference writer pads it.
	var buf bytes.Buffer
	if err := Write(&buf, in, nil); err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(buf.Bytes()); n%8 != 0 {
		t.Errorf("header of %d bytes: not a multiple of 8", n)
	}
}

func TestConversions(t *testing.T) {
	cases := []struct {
		name  string
		dtype string
		raw   []byte
		want  float32
	}{
		{"bf16 one", "BF16", []byte{0x80, 0x3f}, 1},
		{"bf16 -2", "BF16", []byte{0x00, 0xc0}, -2},
		{"f16 one", "F16", []byte{0x00, 0x3c}, 1},
		{"f16 -0.5", "F16", []byte{0x00, 0xb8}, -0.5},
		{"f16 max", "F16", []byte{0xff, 0x7b}, 65504},
		{"f16 smallest subnormal", "F16", []byte{0x01, 0x00}, float32(math.Ldexp(1, -24))},
		{"f16 inf", "F16", []byte{0x00, 0x7c}, float32(math.Inf(1))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, err := Tensor{DType: c.dtype, Shape: []int{1}, Data: c.raw}.Float32s()
			if err != nil || v[0] != c.want {
				t.Errorf("got %v (%v), want %v", v, err, c.want)
			}
		})
	}
	// bfloat16 rounding: to nearest, ties to even.
	for _, c := range []struct {
		in   uint32
		want uint16
	}{{0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81}, {0x7fc00000, 0x7fc0}} {
		if got := toBF16(math.Float32frombits(c.in)); got != c.want {
			t.Errorf("bf16(%#x) = %#x, want %#x", c.in, got, c.want)
		}
	}
}

func TestParseRejects(t *testing.T) {
	header := func(h string, data int) []byte {
		b := make([]byte, 8, 8+len(h)+data)
		binary.LittleEndian.PutUint64(b, uint64(len(h)))
		b = append(b, h...)
		return append(b, make([]byte, data)...)
	}
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"short", []byte{1, 2}, "too short"},
		{"huge header", binary.LittleEndian.AppendUint64(nil, 1<<40), "header of"},
		{"bad json", header("{", 0), "header"},
		{"unknown dtype", header(`{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}`, 1), "unknown dtype"},
		{"offsets past the end", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 4), "offsets"},
		{"size mismatch", header(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, 8), "offsets"},
		{"negative dim", header(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}`, 0), "bad shape"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(c.b)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one mentioning %q", err, c.want)
			}
		})
	}
}
