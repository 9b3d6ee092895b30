package ipc

import (
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// TestIntegerFieldsOutOfRange: every integer field refuses a value its Go
// type cannot hold (msgpack's decoder would wrap it) and accepts its
// extremes; the error names the field.
func TestIntegerFieldsOutOfRange(t *testing.T) {
	item := func(k string, v any) map[string]any {
		it := map[string]any{"tensor": 1, "grad": map[string]any{"seg": 1, "off": 0, "nbytes": 4}, "apply": true, "step": 1}
		switch k {
		case "seg", "off", "nbytes":
			it["grad"].(map[string]any)[k] = v
		default:
			it[k] = v
		}
		return map[string]any{"items": []any{it}}
	}
	tests := []struct {
		name string
		op   string
		v    any // the decode target
		body any
		want string // "" = accepted
	}{
		{"u32 2^32+1 (used to become 1)", OpStep, &Step{}, item("tensor", uint64(math.MaxUint32)+2), "items[0].tensor: 4294967297 out of range for u32"},
		{"u32 max", OpStep, &Step{}, item("tensor", uint64(math.MaxUint32)), ""},
		{"u32 negative", OpStep, &Step{}, item("tensor", -1), "items[0].tensor: -1 out of range for u32"},
		{"segment 2^32", OpStep, &Step{}, item("seg", int64(1)<<32), "items[0].grad.seg: 4294967296 out of range"},
		{"int 2^63 (used to become negative)", OpStep, &Step{}, item("off", uint64(1)<<63), "items[0].grad.off: 9223372036854775808 out of range for int"},
		{"int max", OpStep, &Step{}, item("step", int64(math.MaxInt64)), ""},
		{"int min", OpStep, &Step{}, item("nbytes", int64(math.MinInt64)), ""},
		{"shape dimension 2^64-1", OpRegister, &Register{}, map[string]any{"tensors": []any{map[string]any{"name": "x", "shape": []any{1, uint64(math.MaxUint64)}}}},
			"tensors[0].shape[1]: 18446744073709551615 out of range for int"},
		{"detach u32", OpDetach, &Detach{}, map[string]any{"seg": uint64(1) << 40}, "seg: 1099511627776 out of range for u32"},
		{"export tensor", OpExport, &StateXfer{}, map[string]any{"tensor": int64(-5)}, "tensor: -5 out of range for u32"},
		{"unknown keys are not checked", OpDetach, &Detach{}, map[string]any{"seg": 3, "extra": uint64(math.MaxUint64)}, ""},
		{"lanes", OpStep, &Step{}, item("scalars", map[string]any{"lanes": uint64(1) << 63}), "items[0].scalars.lanes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := msgpack.Marshal(tc.body)
			if err != nil {
				t.Fatal(err)
			}
			err = DecodeBody(Request{Op: tc.op, Body: b}, tc.v)
			if tc.want == "" {
				if err != nil && strings.Contains(err.Error(), "out of range for") {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestEnvelopeIDOutOfRange(t *testing.T) {
	b, _ := msgpack.Marshal(map[string]any{"v": 1, "op": "stats", "id": -1})
	if _, err := DecodeRequest(b); err == nil || !strings.Contains(err.Error(), "id: -1 out of range for u64") {
		t.Fatalf("id -1: %v", err)
	}
	b, _ = msgpack.Marshal(map[string]any{"v": 1, "op": "stats", "id": uint64(math.MaxUint64)})
	if r, err := DecodeRequest(b); err != nil || r.ID != math.MaxUint64 {
		t.Fatalf("id 2^64-1: %+v %v", r, err)
	}
}

func BenchmarkCheckIntRanges(b *testing.B) {
	st := Step{}
	for i := range 8 {
		st.Items = append(st.Items, StepItem{Tensor: uint32(i + 1), Grad: MemRef{Seg: 2, Offset: int64(i) << 14, Bytes: 16384},
			Apply: true, Step: 7, Scalars: ScalarsMsg{Decay: 1, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-3, BC2Sqrt: 1, Eps: 1e-8}})
	}
	body, _ := msgpack.Marshal(st)
	b.ReportAllocs()
	for b.Loop() {
		if err := CheckIntRanges(body, reflect.TypeOf(&st)); err != nil {
			b.Fatal(err)
		}
	}
}
