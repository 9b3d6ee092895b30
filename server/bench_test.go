package server

import (
	"math/rand/v2"
	"testing"

	"github.com/sonar-moe/sonar/backend/cpu"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// BenchmarkStepRequest is the server's cost of one step request of 8 small
// float32 tensors (4096 elements each), decoding included: the per-request
// overhead (validation, segment checks) next to tiny updates.
func BenchmarkStepRequest(b *testing.B) {
	const n, items = 4096, 8
	dir := b.TempDir()
	s := New(zap.NewNop(), cpu.New(ipcbridge.ShmMapper{Dir: dir, Unlink: true}, 2)) // as sonard makes it
	b.Cleanup(s.Close)
	h := &harness{t: &testing.T{}, dir: dir, s: s, rng: rand.New(rand.NewPCG(1, 2))}
	params, grads := h.newSegment("sonar-bp", 4*n*items), h.newSegment("sonar-bg", 4*n*items)
	h.attach("c", params)
	h.attach("c", grads)
	var specs []ipc.TensorSpec
	for i := range items {
		specs = append(specs, ipc.TensorSpec{Name: string(rune('a' + i)), Shape: []int64{n}, DType: "float32",
			Param: ipc.MemRef{Seg: params.id, Offset: int64(4 * n * i), Bytes: 4 * n}, Hyper: ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999}})
	}
	ids := h.must("c", ipc.OpRegister, ipc.Register{Tensors: specs}).(ipc.RegisterReply).IDs
	sc := ipc.ScalarsMsg{Decay: 1, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-3, BC2Sqrt: 1, Eps: 1e-8}
	b.ResetTimer()
	for k := range b.N {
		st := ipc.Step{}
		for i, id := range ids {
			st.Items = append(st.Items, ipc.StepItem{Tensor: id, Grad: ipc.MemRef{Seg: grads.id, Offset: int64(4 * n * i), Bytes: 4 * n},
				Apply: true, Step: int64(k + 1), Scalars: sc})
		}
		body, _ := msgpack.Marshal(st)
		msg, _ := msgpack.Marshal(map[string]any{"v": ipc.Version, "op": ipc.OpStep, "id": k + 1, "body": msgpack.RawMessage(body)})
		req, err := ipc.DecodeRequest(msg)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := h.s.Handle("c", req); err != nil {
			b.Fatal(err)
		}
	}
}
