package server

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/sonar-moe/sonar/backend/cpu"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// FuzzHandle sends arbitrary messages to a server holding one registered
// tensor that has taken a step: nothing may panic, and a request answered
// with an error must not change a byte of the parameter or its state.
//
//	go test -fuzz=FuzzHandle -fuzztime=10m ./server/
func FuzzHandle(f *testing.F) {
	seed := func(op string, body any) []byte {
		b, _ := msgpack.Marshal(body)
		m, _ := msgpack.Marshal(ipc.Request{V: ipc.Version, Op: op, ID: 7, Body: b})
		return m
	}
	sc := ipc.ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001,
		NegStepSize: -1e-3, BC2Sqrt: 0.0447, Eps: 1e-8}
	step := ipc.Step{Items: []ipc.StepItem{{Tensor: 3, Grad: ipc.MemRef{Seg: 2, Offset: 0, Bytes: 1024}, Apply: true, Step: 2, Scalars: sc}}}
	f.Add(seed(ipc.OpStep, step))
	step.Items[0].Grad.Offset = 4000
	f.Add(seed(ipc.OpStep, step))
	f.Add(seed(ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "x", Shape: []int64{16}, DType: "bfloat16", Param: ipc.MemRef{Seg: 1, Offset: 2048, Bytes: 32}}}}))
	f.Add(seed(ipc.OpRegister, ipc.Register{More: true, Tensors: []ipc.TensorSpec{{Name: "y", Shape: []int64{16}, DType: "float32", Param: ipc.MemRef{Seg: 1, Offset: 2048, Bytes: 64}}}}))
	f.Add(seed(ipc.OpExport, ipc.StateXfer{Tensor: 3, ExpAvg: ipc.MemRef{Seg: 2, Bytes: 1024}, ExpAvgSq: ipc.MemRef{Seg: 2, Offset: 1024, Bytes: 1024}}))
	f.Add(seed(ipc.OpImport, ipc.StateXfer{Tensor: 3, Step: 9, ExpAvg: ipc.MemRef{Seg: 2, Bytes: 1024}, ExpAvgSq: ipc.MemRef{Seg: 2, Offset: 1024, Bytes: 1024}}))
	f.Add(seed(ipc.OpDetach, ipc.Detach{Seg: 1}))
	f.Add(seed(ipc.OpDiscard, ipc.Discard{Tensors: []uint32{3}}))
	f.Add(seed(ipc.OpAttach, ipc.Attach{Shm: "sonar-../../x", Size: 4096}))
	dir := f.TempDir()
	n := 0
	f.Fuzz(func(t *testing.T, data []byte) {
		n++
		s, param, tn := fuzzServer(t, dir, n)
		defer s.Close()
		req, err := ipc.DecodeRequest(data)
		if err != nil {
			return
		}
		before := [][]byte{bytes.Clone(param), bytes.Clone(tn.ExpAvg), bytes.Clone(tn.ExpAvgSq)}
		stepBefore := tn.Step
		if _, err := s.Handle("c", req); err == nil {
			return
		}
		after := [][]byte{param, tn.ExpAvg, tn.ExpAvgSq}
		for i := range before {
			if !bytes.Equal(before[i], after[i]) {
				t.Fatalf("failed %s request changed buffer %d", req.Op, i)
			}
		}
		if tn.Step != stepBefore {
			t.Fatalf("failed %s request changed the step", req.Op)
		}
	})
}

// fuzzServer returns a server with segments 1 (params, 4096 B) and 2
// (gradients, 4096 B) attached and tensor 3 ("w", 256 float32) registered
// and stepped once, plus the parameter memory and the tensor.
func fuzzServer(t *testing.T, dir string, n int) (*Server, []byte, *optimizer.Tensor) {
	s := New(zap.NewNop(), &cpu.Backend{Mapper: ipcbridge.ShmMapper{Dir: dir, Unlink: true}, Workers: 1})
	for i, name := range []string{fmt.Sprintf("sonar-p%d", n), fmt.Sprintf("sonar-g%d", n)} {
		path := filepath.Join(dir, name)
		init := make([]byte, 4096)
		x := optimizer.F32s(init)
		for j := range x {
			x[j] = float32(j%17-8) * 0.125
		}
		if err := os.WriteFile(path, init, 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Handle("c", mustReq(t, ipc.OpAttach, ipc.Attach{Shm: name, Size: 4096})); err != nil {
			t.Fatal(err)
		}
		_ = i
	}
	reg := ipc.Register{Tensors: []ipc.TensorSpec{{Name: "w", Shape: []int64{256}, DType: "float32",
		Param: ipc.MemRef{Seg: 1, Bytes: 1024}, Hyper: ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}}}}
	if _, err := s.Handle("c", mustReq(t, ipc.OpRegister, reg)); err != nil {
		t.Fatal(err)
	}
	sc := ipc.ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-2, BC2Sqrt: 0.0316, Eps: 1e-8}
	st := ipc.Step{Items: []ipc.StepItem{{Tensor: 3, Grad: ipc.MemRef{Seg: 2, Bytes: 1024}, Apply: true, Step: 1, Scalars: sc}}}
	if _, err := s.Handle("c", mustReq(t, ipc.OpStep, st)); err != nil {
		t.Fatal(err)
	}
	tn, ok := cpu.State(s.sessions["c"].tensors[3].state)
	if !ok {
		t.Fatal("tensor 3 is not a CPU tensor")
	}
	return s, tn.Param, tn
}

func mustReq(t *testing.T, op string, body any) ipc.Request {
	b, err := msgpack.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	return ipc.Request{V: ipc.Version, Op: op, ID: 1, Body: b}
}
