package ipc

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// envelope builds a request message as the Python client does: a map with
// v, op, id and body.
func envelope(t *testing.T, v int, op string, id uint64, body any) []byte {
	t.Helper()
	m := map[string]any{"v": v, "op": op, "id": id}
	if body != nil {
		m["body"] = body
	}
	return mustMarshal(t, m)
}

func TestDecodeRequest(t *testing.T) {
	good := envelope(t, Version, OpStats, 42, map[string]any{})
	oversize := envelope(t, Version, OpStats, 43, map[string]any{"pad": make([]byte, MaxMessageBytes)})
	cases := []struct {
		name    string
		msg     []byte
		wantErr string // "" means ok
		wantID  uint64 // id the failed decode still reports
		wantOp  string
	}{
		{"good", good, "", 42, OpStats},
		{"unknown fields ignored", mustMarshal(t, map[string]any{"v": Version, "op": "x", "id": 1, "extra": []int{1, 2}}), "", 1, "x"},
		{"empty", nil, "malformed msgpack", 0, ""},
		{"never-used byte", []byte{0xc1}, "malformed msgpack", 0, ""},
		{"truncated", good[:len(good)-3], "malformed msgpack", 0, ""},
		{"not a map", mustMarshal(t, []int{1, 2, 3}), "malformed msgpack", 0, ""},
		{"version as string", mustMarshal(t, map[string]any{"v": "1", "op": "stats", "id": 1}), "malformed msgpack", 0, ""},
		{"wrong version 2", envelope(t, 2, OpStats, 7, nil), "unsupported protocol version 2 (server speaks 1)", 7, OpStats},
		{"missing version", mustMarshal(t, map[string]any{"op": "stats", "id": 8}), "unsupported protocol version 0 (server speaks 1)", 8, OpStats},
		{"missing op", mustMarshal(t, map[string]any{"v": Version, "id": 9}), "missing op", 9, ""},
		{"empty op", envelope(t, Version, "", 10, nil), "missing op", 10, ""},
		{"oversize", oversize, "exceeds", 0, ""},
	}
	for _, tc := range cases {
		r, err := DecodeRequest(tc.msg)
		if tc.wantErr == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
		} else {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.wantErr)
				continue
			}
			if !errors.Is(err, ErrProtocol) {
				t.Errorf("%s: error does not wrap ErrProtocol", tc.name)
			}
		}
		if r.ID != tc.wantID || r.Op != tc.wantOp {
			t.Errorf("%s: decoded id %d op %q, want %d %q", tc.name, r.ID, r.Op, tc.wantID, tc.wantOp)
		}
	}
	if len(oversize) <= MaxMessageBytes {
		t.Fatal("oversize message is not over the limit")
	}

	// A message of exactly MaxMessageBytes is accepted.
	pad := MaxMessageBytes - 100
	for range 3 {
		msg := envelope(t, Version, OpStats, 44, map[string]any{"pad": make([]byte, pad)})
		pad += MaxMessageBytes - len(msg)
		if len(msg) == MaxMessageBytes {
			if _, err := DecodeRequest(msg); err != nil {
				t.Errorf("message of exactly MaxMessageBytes: %v", err)
			}
			return
		}
	}
	t.Error("could not build a message of exactly MaxMessageBytes")
}

func TestDecodeBody(t *testing.T) {
	reg := Register{Tensors: []TensorSpec{{Name: "w", Shape: []int64{2, 3}, DType: "float32", Param: MemRef{Seg: 1, Bytes: 24}}}}
	cases := []struct {
		name    string
		body    []byte
		into    any
		wantErr string
	}{
		{"good register", mustMarshal(t, reg), &Register{}, ""},
		{"good hello (no Validate)", mustMarshal(t, Hello{Client: "c", PID: 3}), &Hello{}, ""},
		{"missing body", nil, &Register{}, "missing body"},
		{"malformed body", []byte{0xc1}, &Register{}, "malformed body"},
		{"body of the wrong type", mustMarshal(t, "a string"), &Register{}, "malformed body"},
		{"field of the wrong type", mustMarshal(t, map[string]any{"tensors": "no"}), &Register{}, "malformed body"},
		{"validation runs", mustMarshal(t, Register{}), &Register{}, "0 tensors"},
		{"attach validation", mustMarshal(t, Attach{Shm: "sonar-x", Size: 0}), &Attach{}, "positive size"},
		{"attach without name", mustMarshal(t, Attach{Size: 10}), &Attach{}, "needs a name"},
		{"attach ok", mustMarshal(t, Attach{Shm: "sonar-x", Size: 10}), &Attach{}, ""},
	}
	for _, tc := range cases {
		err := DecodeBody(Request{V: Version, Op: "op", ID: 1, Body: tc.body}, tc.into)
		if tc.wantErr == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.wantErr)
		} else if !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: error does not wrap ErrProtocol", tc.name)
		}
	}
	var got Register
	if err := DecodeBody(Request{Op: OpRegister, Body: mustMarshal(t, reg)}, &got); err != nil {
		t.Fatal(err)
	}
	if got.Tensors[0].Name != "w" || got.Tensors[0].Numel() != 6 || got.Tensors[0].Param.Bytes != 24 {
		t.Errorf("decoded %+v", got)
	}
}

func goodSpec(name string) TensorSpec {
	return TensorSpec{Name: name, Shape: []int64{4, 8, 16}, DType: "float32", Param: MemRef{Seg: 1, Offset: 0, Bytes: 4 * 8 * 16 * 4},
		Hyper: HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}}
}

func TestRegisterValidate(t *testing.T) {
	many := make([]TensorSpec, MaxItems+1)
	for i := range many {
		many[i] = goodSpec("t")
	}
	mod := func(f func(*TensorSpec)) []TensorSpec {
		s := goodSpec("w")
		f(&s)
		return []TensorSpec{s}
	}
	cases := []struct {
		name    string
		tensors []TensorSpec
		wantErr string
	}{
		{"good", []TensorSpec{goodSpec("a"), goodSpec("b")}, ""},
		{"max items", many[:MaxItems], ""},
		{"max dims", mod(func(s *TensorSpec) { s.Shape = make([]int64, MaxDims); fill(s.Shape, 2) }), ""},
		{"max name length", mod(func(s *TensorSpec) { s.Name = strings.Repeat("n", MaxNameLen) }), ""},
		{"largest numel", mod(func(s *TensorSpec) { s.Shape = []int64{1 << 20, 1 << 20} }), ""},
		{"no tensors", nil, "0 tensors"},
		{"too many tensors", many, "4097 tensors"},
		{"empty name", mod(func(s *TensorSpec) { s.Name = "" }), "name length 0"},
		{"name too long", mod(func(s *TensorSpec) { s.Name = strings.Repeat("n", MaxNameLen+1) }), "name length"},
		{"no dims", mod(func(s *TensorSpec) { s.Shape = nil }), "0 dims"},
		{"too many dims", mod(func(s *TensorSpec) { s.Shape = make([]int64, MaxDims+1); fill(s.Shape, 1) }), "9 dims"},
		{"zero dim", mod(func(s *TensorSpec) { s.Shape = []int64{4, 0, 2} }), "out of range"},
		{"negative dim", mod(func(s *TensorSpec) { s.Shape = []int64{-4, -2} }), "out of range"},
		{"dim too large", mod(func(s *TensorSpec) { s.Shape = []int64{1<<40 + 1} }), "out of range"},
		{"product too large", mod(func(s *TensorSpec) { s.Shape = []int64{1 << 20, 1<<20 + 1} }), "out of range"},
		{"product overflows int64", mod(func(s *TensorSpec) { s.Shape = []int64{1 << 32, 1 << 32, 1 << 32} }), "out of range"},
		{"product wraps to a small number", mod(func(s *TensorSpec) { s.Shape = []int64{1 << 31, 1 << 31, 1 << 31, 1 << 31, 4} }), "out of range"},
		{"nan lr", mod(func(s *TensorSpec) { s.Hyper.LR = math.NaN() }), "non-finite"},
		{"inf beta1", mod(func(s *TensorSpec) { s.Hyper.Beta1 = math.Inf(1) }), "non-finite"},
		{"nan beta2", mod(func(s *TensorSpec) { s.Hyper.Beta2 = math.NaN() }), "non-finite"},
		{"-inf eps", mod(func(s *TensorSpec) { s.Hyper.Eps = math.Inf(-1) }), "non-finite"},
		{"inf weight decay", mod(func(s *TensorSpec) { s.Hyper.WeightDecay = math.Inf(1) }), "non-finite"},
		{"second tensor bad", []TensorSpec{goodSpec("a"), {Name: "b"}}, "0 dims"},
	}
	for _, tc := range cases {
		r := Register{Tensors: tc.tensors}
		err := r.Validate()
		checkValidate(t, tc.name, err, tc.wantErr)
	}
}

func fill(s []int64, v int64) {
	for i := range s {
		s[i] = v
	}
}

func goodScalars() ScalarsMsg {
	return ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001,
		NegStepSize: -0.01, BC2Sqrt: 0.0316, Eps: 1e-8}
}

func withScale(it StepItem, s float64) StepItem {
	it.GradScale = s
	return it
}

func TestStepValidate(t *testing.T) {
	item := func(tensor uint32, apply bool) StepItem {
		return StepItem{Tensor: tensor, Grad: MemRef{Seg: 2, Offset: 512, Bytes: 64}, Apply: apply, Step: 1, Scalars: goodScalars()}
	}
	withScalar := func(apply bool, f func(*ScalarsMsg)) []StepItem {
		it := item(1, apply)
		f(&it.Scalars)
		return []StepItem{it}
	}
	many := make([]StepItem, MaxItems+1)
	for i := range many {
		many[i] = item(uint32(i+1), true)
	}
	noGrad := item(1, true)
	noGrad.Grad = MemRef{}
	noGradNoApply := item(1, false)
	noGradNoApply.Grad = MemRef{}
	nan, inf := math.NaN(), math.Inf(1)
	cases := []struct {
		name    string
		items   []StepItem
		wantErr string
	}{
		{"apply", []StepItem{item(1, true), item(2, true)}, ""},
		{"accumulate", []StepItem{item(1, false)}, ""},
		{"max items", many[:MaxItems], ""},
		{"apply what was accumulated", []StepItem{noGrad}, ""},
		{"no items", nil, "0 items"},
		{"too many items", many, "4097 items"},
		{"duplicate tensor", []StepItem{item(1, true), item(2, true), item(1, false)}, "tensor 1 appears twice"},
		{"no grad, no apply", []StepItem{noGradNoApply}, "nothing to apply"},
		{"nan decay", withScalar(true, func(s *ScalarsMsg) { s.Decay = nan }), "non-finite"},
		{"inf beta1_w", withScalar(true, func(s *ScalarsMsg) { s.Beta1W = inf }), "non-finite"},
		{"nan beta2", withScalar(true, func(s *ScalarsMsg) { s.Beta2 = nan }), "non-finite"},
		{"-inf one_minus_beta2", withScalar(true, func(s *ScalarsMsg) { s.OneMinusB2 = -inf }), "non-finite"},
		{"-inf step size", withScalar(true, func(s *ScalarsMsg) { s.NegStepSize = -inf }), "non-finite"},
		{"nan bc2_sqrt", withScalar(true, func(s *ScalarsMsg) { s.BC2Sqrt = nan }), "non-finite"},
		{"inf eps", withScalar(true, func(s *ScalarsMsg) { s.Eps = inf }), "non-finite"},
		{"grad_scale", []StepItem{withScale(item(1, true), 0.25)}, ""},
		{"grad_scale when accumulating", []StepItem{withScale(item(1, false), 0.25)}, "grad_scale"},
		{"negative grad_scale", []StepItem{withScale(item(1, true), -0.5)}, "grad_scale"},
		{"nan grad_scale", []StepItem{withScale(item(1, true), nan)}, "grad_scale"},
		{"grad_scale zero in float32", []StepItem{withScale(item(1, true), 1e-50)}, "grad_scale"},
		{"grad_scale inf in float32", []StepItem{withScale(item(1, true), 1e39)}, "grad_scale"},
		// Scalars are ignored when accumulating.
		{"nan scalars when accumulating", withScalar(false, func(s *ScalarsMsg) {
			*s = ScalarsMsg{Decay: nan, Beta1W: nan, Beta2: inf, OneMinusB2: nan, NegStepSize: -inf, BC2Sqrt: nan, Eps: nan}
		}), ""},
	}
	for _, tc := range cases {
		s := Step{Items: tc.items}
		err := s.Validate()
		checkValidate(t, tc.name, err, tc.wantErr)
	}
}

func TestDiscardValidate(t *testing.T) {
	ids := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(i + 1)
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		tensors []uint32
		wantErr string
	}{
		{"one", []uint32{7}, ""},
		{"max items", ids(MaxItems), ""},
		{"tensor id 0 (the server refuses it as unknown)", []uint32{0}, ""},
		{"none", nil, "0 tensors (want 1..4096)"},
		{"too many", ids(MaxItems + 1), "4097 tensors"},
		{"duplicate", []uint32{3, 4, 3}, "tensors[2]: tensor 3 appears twice"},
	} {
		d := Discard{Tensors: tc.tensors}
		err := d.Validate()
		checkValidate(t, tc.name, err, tc.wantErr)
	}
}

func TestEncodeReply(t *testing.T) {
	cases := []struct {
		name string
		in   Reply
	}{
		{"ok with body", Reply{V: 99, ID: 5, OK: true, Body: AttachReply{Seg: 3}}},
		{"error", Reply{V: 0, ID: 6, Error: "nope"}},
		{"id 0", Reply{Error: "protocol error: malformed"}},
	}
	for _, tc := range cases {
		b, err := EncodeReply(tc.in)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		var m map[string]any
		if err := msgpack.Unmarshal(b, &m); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if v, _ := m["v"].(int8); int(v) != Version {
			t.Errorf("%s: v = %v (%T), want %d", tc.name, m["v"], m["v"], Version)
		}
		var r Reply
		if err := msgpack.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		if r.ID != tc.in.ID || r.OK != tc.in.OK || r.Error != tc.in.Error {
			t.Errorf("%s: decoded %+v", tc.name, r)
		}
		if _, has := m["error"]; has != (tc.in.Error != "") {
			t.Errorf("%s: error field present=%v", tc.name, has)
		}
		if _, has := m["body"]; has != (tc.in.Body != nil) {
			t.Errorf("%s: body field present=%v", tc.name, has)
		}
	}
	// Body field names are those of the protocol.
	b, err := EncodeReply(Reply{ID: 1, OK: true, Body: StepReply{Applied: 2, Accumulated: 1, Bytes: 96, Micros: 7}})
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Body map[string]int64 `msgpack:"body"`
	}
	if err := msgpack.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"applied": 2, "accumulated": 1, "bytes": 96, "micros": 7}
	for k, v := range want {
		if m.Body[k] != v {
			t.Errorf("step reply body %v, want %v", m.Body, want)
			break
		}
	}
	// A body msgpack cannot encode is an error, not a panic.
	if _, err := EncodeReply(Reply{ID: 2, OK: true, Body: make(chan int)}); err == nil {
		t.Error("encoding a channel succeeded")
	}
}

// The CUDA additions are optional on the wire: bodies without the new
// fields decode as before, replies without CUDA omit them.
func TestCUDABodies(t *testing.T) {
	torch := append([]byte{1, 'c'}, make([]byte, 64)...)
	cases := []struct {
		name    string
		body    []byte
		into    any
		wantErr string
	}{
		{"attach_cuda torch handle", mustMarshal(t, AttachCUDA{Handle: torch, Size: 4096}), &AttachCUDA{}, ""},
		{"attach_cuda raw handle, size unchecked", mustMarshal(t, map[string]any{"handle": make([]byte, 64)}), &AttachCUDA{}, ""},
		{"attach_cuda short handle", mustMarshal(t, AttachCUDA{Handle: make([]byte, 63)}), &AttachCUDA{}, "handle of 63 bytes"},
		{"attach_cuda no handle", mustMarshal(t, map[string]any{"size": 10}), &AttachCUDA{}, "handle of 0 bytes"},
		{"attach_cuda negative size", mustMarshal(t, AttachCUDA{Handle: torch, Size: -5}), &AttachCUDA{}, "negative size"},
		{"attach_cuda handle as string", mustMarshal(t, map[string]any{"handle": 5}), &AttachCUDA{}, "malformed body"},
		{"cuda_event ok", mustMarshal(t, CUDAEvent{Handle: make([]byte, 64)}), &CUDAEvent{}, ""},
		{"cuda_event torch-length handle", mustMarshal(t, CUDAEvent{Handle: torch}), &CUDAEvent{}, "event handle of 66 bytes"},
		{"step with wait_event", mustMarshal(t, map[string]any{"items": []any{map[string]any{"tensor": 1, "grad": map[string]any{"seg": 2, "off": 0, "nbytes": 4}}}, "wait_event": true}), &Step{}, ""},
	}
	for _, tc := range cases {
		err := DecodeBody(Request{V: Version, Op: "op", ID: 1, Body: tc.body}, tc.into)
		if tc.wantErr == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: error %v, want an ErrProtocol containing %q", tc.name, err, tc.wantErr)
		}
	}
	var st Step
	if err := DecodeBody(Request{Op: OpStep, Body: mustMarshal(t, map[string]any{"items": []any{map[string]any{"tensor": 1, "grad": map[string]any{"seg": 2, "nbytes": 4}}}})}, &st); err != nil || st.WaitEvent {
		t.Errorf("step without wait_event: %+v, %v", st, err)
	}
	var m map[string]any
	if err := msgpack.Unmarshal(mustMarshal(t, HelloReply{Server: "x", Protocol: Version}), &m); err != nil {
		t.Fatal(err)
	}
	if _, ok := m["cuda"]; ok {
		t.Errorf("hello reply without CUDA carries a cuda key: %v", m)
	}
}

// checkValidate reports a Validate error that is not the one a case wants
// ("" wants none; otherwise an error containing want).
func checkValidate(t *testing.T, name string, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Errorf("%s: %v", name, err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Errorf("%s: error %v, want one containing %q", name, err, want)
	}
}
