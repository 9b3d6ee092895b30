package server

import (
	"bytes"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/sonar-moe/sonar/backend/cpu"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// segment is a shared-memory segment the test created, as a client does: a
// mode 0600 file in the mapper's directory, mapped here too.
type testSegment struct {
	name string
	mem  []byte
	id   uint32 // server's id once attached
}

type harness struct {
	t   *testing.T
	dir string
	s   *Server
	rng *rand.Rand
	id  uint64
}

func newHarness(t *testing.T) *harness {
	dir := t.TempDir()
	s := New(zap.NewNop(), &cpu.Backend{Mapper: ipcbridge.ShmMapper{Dir: dir, Unlink: true}, Workers: 2, MinChunk: 16})
	s.Workers = 2
	t.Cleanup(s.Close)
	return &harness{t: t, dir: dir, s: s, rng: rand.New(rand.NewPCG(1, 2))}
}

// newSegment creates a segment filled with random float32 N(0,1) values.
func (h *harness) newSegment(name string, size int) *testSegment {
	h.t.Helper()
	path := filepath.Join(h.dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		h.t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		h.t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = syscall.Munmap(mem) })
	x := optimizer.F32s(mem)
	for i := range x {
		x[i] = float32(h.rng.NormFloat64())
	}
	return &testSegment{name: name, mem: mem}
}

// fillBF16 overwrites [off, off+2n) with random bfloat16 values of scale sd.
func (h *harness) fillBF16(seg *testSegment, off, n int, sd float64) {
	x := optimizer.U16s(seg.mem[off : off+2*n])
	for i := range x {
		x[i] = optimizer.F32ToBF16(float32(h.rng.NormFloat64() * sd))
	}
}

func (h *harness) fillF32(seg *testSegment, off, n int, sd float64) {
	x := optimizer.F32s(seg.mem[off : off+4*n])
	for i := range x {
		x[i] = float32(h.rng.NormFloat64() * sd)
	}
}

type rawBody []byte

func (h *harness) call(client, op string, body any) (any, error) {
	h.t.Helper()
	h.id++
	req := ipc.Request{V: ipc.Version, Op: op, ID: h.id}
	switch b := body.(type) {
	case nil:
	case rawBody:
		req.Body = msgpack.RawMessage(b)
	default:
		enc, err := msgpack.Marshal(body)
		if err != nil {
			h.t.Fatal(err)
		}
		req.Body = enc
	}
	return h.s.Handle(client, req)
}

func (h *harness) must(client, op string, body any) any {
	h.t.Helper()
	rep, err := h.call(client, op, body)
	if err != nil {
		h.t.Fatalf("%s: %v", op, err)
	}
	return rep
}

func (h *harness) attach(client string, seg *testSegment) {
	h.t.Helper()
	rep := h.must(client, ipc.OpAttach, ipc.Attach{Shm: seg.name, Size: int64(len(seg.mem))}).(ipc.AttachReply)
	if rep.Seg == 0 {
		h.t.Fatal("segment id 0")
	}
	seg.id = rep.Seg
}

// tspec is a tensor of the test, with its mirror: an optimizer.Tensor over a
// private copy of the initial parameter, stepped with the engine directly.
type tspec struct {
	name   string
	shape  []int64
	dtype  optimizer.DType
	off    int // of the parameter in the param segment
	hyper  optimizer.Hyper
	id     uint32
	mirror *optimizer.Tensor
}

func (ts *tspec) numel() int {
	n := 1
	for _, d := range ts.shape {
		n *= int(d)
	}
	return n
}
func (ts *tspec) nbytes() int { return ts.numel() * ts.dtype.Size() }

func hyperMsg(h optimizer.Hyper) ipc.HyperMsg {
	return ipc.HyperMsg{LR: h.LR, Beta1: h.Beta1, Beta2: h.Beta2, Eps: h.Eps, WeightDecay: h.WeightDecay, Amsgrad: h.Amsgrad, Maximize: h.Maximize}
}

func scalarsMsg(s optimizer.Scalars) ipc.ScalarsMsg {
	return ipc.ScalarsMsg{Decay: s.Decay, ApplyDecay: s.ApplyDecay, Beta1W: s.Beta1W, Beta2: s.Beta2, OneMinusB2: s.OneMinusB2,
		NegStepSize: s.NegStepSize, BC2Sqrt: s.BC2Sqrt, Eps: s.Eps, Amsgrad: s.Amsgrad, Maximize: s.Maximize}
}

func (ts *tspec) spec(seg *testSegment) ipc.TensorSpec {
	return ipc.TensorSpec{Name: ts.name, Shape: ts.shape, DType: ts.dtype.String(),
		Param: ipc.MemRef{Seg: seg.id, Offset: int64(ts.off), Bytes: int64(ts.nbytes())}, Hyper: hyperMsg(ts.hyper)}
}

// world is a session with three registered tensors (float32; bfloat16 with
// maximize; float32 with amsgrad), a param segment, a grad segment and a
// state segment.
type world struct {
	*harness
	client               string
	params, grads, state *testSegment
	ts                   []*tspec
	mirrorEngine         *optimizer.Engine
}

const segSize = 16384

func newWorld(t *testing.T) *world {
	h := newHarness(t)
	w := &world{harness: h, client: "c1", mirrorEngine: &optimizer.Engine{Workers: 1}}
	w.params = h.newSegment("sonar-params", segSize)
	w.grads = h.newSegment("sonar-grads", segSize)
	w.state = h.newSegment("sonar-state", segSize)
	def := optimizer.Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	w.ts = []*tspec{
		{name: "layer0.experts.gate_up_proj", shape: []int64{3, 5, 7}, dtype: optimizer.Float32, off: 0, hyper: def},
		{name: "layer0.experts.down_proj", shape: []int64{2, 33}, dtype: optimizer.BFloat16, off: 1024,
			hyper: optimizer.Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Maximize: true}},
		{name: "layer1.experts.down_proj", shape: []int64{10}, dtype: optimizer.Float32, off: 2048,
			hyper: optimizer.Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8, Amsgrad: true}},
	}
	h.fillBF16(w.params, w.ts[1].off, w.ts[1].numel(), 1)

	hello := w.must(w.client, ipc.OpHello, ipc.Hello{Client: "test", PID: os.Getpid(), Torch: "none", Threads: 2, Capability: "DEFAULT"}).(ipc.HelloReply)
	if hello.Protocol != ipc.Version || hello.Sqrt != "ieee" || hello.Workers != 2 || hello.Server != Version {
		t.Errorf("hello reply %+v", hello)
	}
	for _, seg := range []*testSegment{w.params, w.grads, w.state} {
		w.attach(w.client, seg)
		if _, err := os.Stat(filepath.Join(h.dir, seg.name)); !os.IsNotExist(err) {
			t.Errorf("%s not unlinked on attach: %v", seg.name, err)
		}
	}
	var specs []ipc.TensorSpec
	for _, ts := range w.ts {
		specs = append(specs, ts.spec(w.params))
		m, err := optimizer.NewTensor(ts.name, ts.dtype, ts.numel(), ts.hyper, bytes.Clone(w.params.mem[ts.off:ts.off+ts.nbytes()]))
		if err != nil {
			t.Fatal(err)
		}
		ts.mirror = m
	}
	rep := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: specs}).(ipc.RegisterReply)
	if len(rep.IDs) != len(w.ts) {
		t.Fatalf("register reply %+v", rep)
	}
	seen := map[uint32]bool{}
	for i, id := range rep.IDs {
		if id == 0 || seen[id] || id == w.params.id || id == w.grads.id {
			t.Fatalf("tensor ids %v not distinct", rep.IDs)
		}
		seen[id] = true
		w.ts[i].id = id
	}
	return w
}

// gradSlot is where tensor i's gradient goes in the grad segment; slot k
// lets a test keep several micro-batches apart.
func (w *world) gradSlot(i, k int) int { return k*4096 + i*1024 + 512 }

// newGrad writes a random gradient for tensor i into slot k.
func (w *world) newGrad(i, k int) ipc.MemRef {
	ts := w.ts[i]
	off := w.gradSlot(i, k)
	if ts.dtype == optimizer.BFloat16 {
		w.fillBF16(w.grads, off, ts.numel(), 1e-2)
	} else {
		w.fillF32(w.grads, off, ts.numel(), 1e-2)
	}
	return ipc.MemRef{Seg: w.grads.id, Offset: int64(off), Bytes: int64(ts.nbytes())}
}

func (w *world) gradBytes(ref ipc.MemRef) []byte {
	return bytes.Clone(w.grads.mem[ref.Offset : ref.Offset+ref.Bytes])
}

func (w *world) server(i int) *optimizer.Tensor {
	return engineTensor(w.s.sessions[w.client].tensors[w.ts[i].id])
}

// engineTensor is the CPU engine's tensor behind a server tensor.
func engineTensor(t *tensor) *optimizer.Tensor {
	ot, ok := cpu.State(t.state)
	if !ok {
		panic("not a CPU tensor")
	}
	return ot
}

func (w *world) param(i int) []byte {
	ts := w.ts[i]
	return w.params.mem[ts.off : ts.off+ts.nbytes()]
}

// item is an apply (or accumulate) of tensor i at its next step.
func (w *world) item(i int, grad ipc.MemRef, apply bool) ipc.StepItem {
	ts := w.ts[i]
	next := w.server(i).Step + 1
	return ipc.StepItem{Tensor: ts.id, Grad: grad, Apply: apply, Step: next, Scalars: scalarsMsg(optimizer.ScalarsFor(ts.hyper, next))}
}

// applyAll applies a fresh gradient to every tensor, on the server and on
// the mirrors, and checks they agree.
func (w *world) applyAll() {
	w.t.Helper()
	var items []ipc.StepItem
	for i, ts := range w.ts {
		g := w.newGrad(i, 0)
		items = append(items, w.item(i, g, true))
		if err := w.mirrorEngine.Apply(ts.mirror, w.gradBytes(g), optimizer.ScalarsFor(ts.hyper, ts.mirror.Step+1)); err != nil {
			w.t.Fatal(err)
		}
	}
	rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: items}).(ipc.StepReply)
	want := 0
	for _, ts := range w.ts {
		want += ts.nbytes()
	}
	if rep.Applied != len(w.ts) || rep.Accumulated != 0 || rep.Bytes != int64(want) {
		w.t.Errorf("step reply %+v", rep)
	}
	w.checkMirrors()
}

func (w *world) checkMirrors() {
	w.t.Helper()
	for i, ts := range w.ts {
		st := w.server(i)
		if !bytes.Equal(w.param(i), ts.mirror.Param) {
			w.t.Fatalf("%s: param differs from the engine's", ts.name)
		}
		if !bytes.Equal(st.ExpAvg, ts.mirror.ExpAvg) || !bytes.Equal(st.ExpAvgSq, ts.mirror.ExpAvgSq) ||
			!bytes.Equal(st.MaxExpAvgSq, ts.mirror.MaxExpAvgSq) || st.Step != ts.mirror.Step {
			w.t.Fatalf("%s: state differs from the engine's", ts.name)
		}
	}
}

func TestAttachRegisterStep(t *testing.T) {
	w := newWorld(t)
	before := make([][]byte, len(w.ts))
	for i := range w.ts {
		before[i] = bytes.Clone(w.param(i))
	}
	w.applyAll()
	for i, ts := range w.ts {
		if bytes.Equal(before[i], w.param(i)) {
			t.Errorf("%s: step did not change the parameter", ts.name)
		}
		if w.server(i).Step != 1 {
			t.Errorf("%s: server step %d", ts.name, w.server(i).Step)
		}
	}
	w.applyAll()
	w.applyAll()
	st := w.s.Stats()
	if st.Tensors != 3 || st.Segments != 3 || st.Sessions != 1 || st.SegmentBytes != 3*segSize || st.StepItems != 9 || st.Errors != 0 {
		t.Errorf("stats %+v", st)
	}
	if st.ByOp[ipc.OpStep] != 3 || st.ByOp[ipc.OpAttach] != 3 || st.ByOp[ipc.OpRegister] != 1 {
		t.Errorf("stats by op %v", st.ByOp)
	}
	stats := w.must(w.client, ipc.OpStats, nil).(ipc.Stats)
	if stats.Tensors != 3 || stats.Requests != st.Requests+1 {
		t.Errorf("stats op %+v", stats)
	}
	// A ping answers nothing, changes nothing, and is counted as a ping.
	if body := w.must("passer-by", ipc.OpPing, nil); body != nil {
		t.Errorf("ping answered %v", body)
	}
	if after := w.s.Stats(); after.Sessions != 1 || after.ByOp[ipc.OpPing] != 1 || after.Requests != stats.Requests+1 {
		t.Errorf("after ping: %+v", after)
	}
	// A second client has its own session and ids.
	seg := w.newSegment("sonar-c2", 4096)
	w.attach("c2", seg)
	if seg.id == w.params.id || seg.id == w.grads.id {
		t.Errorf("second client got segment id %d again", seg.id)
	}
}

// state is every byte a bad request must not change.
type state struct {
	segs    [][]byte
	tensors [][]byte
	meta    string
}

func (w *world) snapshot() state {
	var s state
	for _, seg := range []*testSegment{w.params, w.grads, w.state} {
		s.segs = append(s.segs, bytes.Clone(seg.mem))
	}
	var meta []string
	for _, client := range slices.Sorted(maps.Keys(w.s.sessions)) {
		ss := w.s.sessions[client]
		for _, id := range slices.Sorted(maps.Keys(ss.tensors)) {
			t := engineTensor(ss.tensors[id])
			s.tensors = append(s.tensors, bytes.Clone(t.ExpAvg), bytes.Clone(t.ExpAvgSq), bytes.Clone(t.MaxExpAvgSq))
			meta = append(meta, fmt.Sprintf("%s:%d:%s:%d:%d:%d", client, id, t.Name, t.Step, t.Pending(), t.StateBytes()))
		}
		meta = append(meta, fmt.Sprintf("%s:segments=%v", client, slices.Sorted(maps.Keys(ss.segments))))
	}
	st := w.s.Stats()
	meta = append(meta, fmt.Sprintf("tensors=%d segments=%d sessions=%d", st.Tensors, st.Segments, st.Sessions))
	s.meta = strings.Join(meta, " ")
	return s
}

func (a state) diff(b state) string {
	for i := range a.segs {
		if !bytes.Equal(a.segs[i], b.segs[i]) {
			return fmt.Sprintf("segment %d", i)
		}
	}
	if a.meta != b.meta {
		return fmt.Sprintf("tensors/counters %q -> %q", a.meta, b.meta)
	}
	for i := range a.tensors {
		if !bytes.Equal(a.tensors[i], b.tensors[i]) {
			return fmt.Sprintf("state buffer %d", i)
		}
	}
	return ""
}

func TestBadRequestsChangeNothing(t *testing.T) {
	w := newWorld(t)
	w.applyAll() // nonzero state everywhere
	// Tensor 1 has a micro-batch accumulated.
	pending := w.newGrad(1, 1)
	if rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{w.item(1, pending, false)}}).(ipc.StepReply); rep.Accumulated != 1 {
		t.Fatalf("accumulate reply %+v", rep)
	}
	if err := w.mirrorEngine.Accumulate(w.ts[1].mirror, w.gradBytes(pending)); err != nil {
		t.Fatal(err)
	}
	// Another client with a segment and a tensor of its own.
	other := w.newSegment("sonar-other", 4096)
	w.attach("c2", other)
	w.must("c2", ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "x", Shape: []int64{8}, DType: "float32",
		Param: ipc.MemRef{Seg: other.id, Bytes: 32}, Hyper: hyperMsg(w.ts[0].hyper)}}})

	A, B, C := w.ts[0], w.ts[1], w.ts[2]
	g := w.newGrad(0, 2)
	gB := w.newGrad(1, 2)
	aParam := ipc.MemRef{Seg: w.params.id, Offset: int64(A.off), Bytes: int64(A.nbytes())}
	free := ipc.MemRef{Seg: w.params.id, Offset: 8192, Bytes: int64(A.nbytes())}
	nb := int64(A.nbytes())
	stRef := func(k int) ipc.MemRef { return ipc.MemRef{Seg: w.state.id, Offset: int64(k) * 1024, Bytes: nb} }

	step := func(items ...ipc.StepItem) ipc.Step { return ipc.Step{Items: items} }
	withGrad := func(ref ipc.MemRef) ipc.Step { return step(w.item(0, ref, true)) }
	mod := func(it ipc.StepItem, f func(*ipc.StepItem)) ipc.StepItem { f(&it); return it }
	reg := func(specs ...ipc.TensorSpec) ipc.Register { return ipc.Register{Tensors: specs} }
	newSpec := func(f func(*ipc.TensorSpec)) ipc.TensorSpec {
		s := ipc.TensorSpec{Name: "new", Shape: []int64{3, 5, 7}, DType: "float32", Param: free, Hyper: hyperMsg(A.hyper)}
		f(&s)
		return s
	}
	nop := func(*ipc.TensorSpec) {}
	xfer := func(tensor uint32, f func(*ipc.StateXfer)) ipc.StateXfer {
		x := ipc.StateXfer{Tensor: tensor, Step: 3, ExpAvg: stRef(0), ExpAvgSq: stRef(1)}
		f(&x)
		return x
	}

	cases := []struct {
		name    string
		client  string
		op      string
		body    any
		wantErr string
	}{
		// step
		{"unknown tensor", "c1", ipc.OpStep, step(mod(w.item(0, g, true), func(it *ipc.StepItem) { it.Tensor = 999 })), "unknown tensor 999"},
		{"unknown segment", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: 999, Bytes: nb}), "unknown segment 999"},
		{"wrong nbytes", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: g.Offset, Bytes: nb - 4}), "tensor needs"},
		{"nbytes of the whole segment", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Bytes: segSize}), "tensor needs"},
		{"offset out of range", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: segSize - nb + 4, Bytes: nb}), "outside"},
		{"offset past the end", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: 1 << 40, Bytes: nb}), "outside"},
		{"offset near MaxInt64", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: math.MaxInt64 - 8, Bytes: nb}), "outside"},
		{"negative offset", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: -4, Bytes: nb}), "invalid"},
		{"misaligned offset", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: g.Seg, Offset: g.Offset + 2, Bytes: nb}), "not aligned"},
		{"misaligned bfloat16", "c1", ipc.OpStep, step(w.item(1, ipc.MemRef{Seg: gB.Seg, Offset: gB.Offset + 1, Bytes: gB.Bytes}, true)), "not aligned"},
		{"grad is the param", "c1", ipc.OpStep, withGrad(aParam), "overlaps the parameter"},
		{"grad overlaps the param's end", "c1", ipc.OpStep, withGrad(ipc.MemRef{Seg: w.params.id, Offset: int64(A.off) + nb - 4, Bytes: nb}), "overlaps the parameter"},
		{"grad overlaps the param's start", "c1", ipc.OpStep, step(w.item(1, ipc.MemRef{Seg: w.params.id, Offset: int64(B.off) - gB.Bytes + 2, Bytes: gB.Bytes}, true)), "overlaps the parameter"},
		{"client step behind", "c1", ipc.OpStep, step(mod(w.item(0, g, true), func(it *ipc.StepItem) { it.Step-- })), "client step 1 but server is at step 1"},
		{"client step ahead", "c1", ipc.OpStep, step(mod(w.item(0, g, true), func(it *ipc.StepItem) { it.Step++ })), "client step 3"},
		{"amsgrad in step, not registered", "c1", ipc.OpStep, step(mod(w.item(0, g, true), func(it *ipc.StepItem) { it.Scalars.Amsgrad = true })),
			"amsgrad differs from registration (registered amsgrad=false)"},
		{"amsgrad registered, not in step", "c1", ipc.OpStep, step(mod(w.item(2, w.newGrad(2, 2), true), func(it *ipc.StepItem) { it.Scalars.Amsgrad = false })),
			"amsgrad differs from registration (registered amsgrad=true)"},
		{"amsgrad differs, maximize toggled too", "c1", ipc.OpStep, step(mod(w.item(1, gB, true), func(it *ipc.StepItem) { it.Scalars.Amsgrad, it.Scalars.Maximize = true, false })),
			"amsgrad differs from registration (registered amsgrad=false)"},
		{"nothing accumulated to apply", "c1", ipc.OpStep, step(w.item(0, ipc.MemRef{}, true)), "nothing accumulated"},
		{"non-finite scalar", "c1", ipc.OpStep, step(mod(w.item(0, g, true), func(it *ipc.StepItem) { it.Scalars.NegStepSize = math.Inf(-1) })), "non-finite"},
		{"duplicate item", "c1", ipc.OpStep, step(w.item(0, g, true), w.item(0, g, false)), "appears twice"},
		{"first item good, second unknown", "c1", ipc.OpStep, step(w.item(0, g, true), w.item(1, gB, true), mod(w.item(2, g, true), func(it *ipc.StepItem) { it.Tensor = 777 })), "unknown tensor 777"},
		{"first item good, second overlaps", "c1", ipc.OpStep, step(w.item(0, g, true), w.item(1, ipc.MemRef{Seg: w.params.id, Offset: int64(B.off), Bytes: gB.Bytes}, true)), "overlaps"},
		{"accumulate good, apply bad step", "c1", ipc.OpStep, step(w.item(0, g, false), mod(w.item(1, gB, true), func(it *ipc.StepItem) { it.Step = 9 })), "client step 9"},
		{"malformed body", "c1", ipc.OpStep, rawBody{0xc1}, "malformed body"},
		{"missing body", "c1", ipc.OpStep, nil, "missing body"},
		{"another client's tensor", "c2", ipc.OpStep, step(w.item(0, ipc.MemRef{Seg: other.id, Bytes: nb}, true)), "unknown tensor"},
		// register
		{"duplicate registration", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Name = A.name })), "already registered"},
		{"duplicate within a request", "c1", ipc.OpRegister, reg(newSpec(nop), newSpec(func(s *ipc.TensorSpec) { s.Param.Offset += 1024 })), "appears twice"},
		{"bad dtype", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.DType = "float16" })), "unsupported dtype"},
		{"good then bad dtype", "c1", ipc.OpRegister, reg(newSpec(nop), newSpec(func(s *ipc.TensorSpec) { s.Name, s.DType = "new2", "float64" })), "unsupported dtype"},
		{"param nbytes not the shape's", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Shape = []int64{3, 5, 8} })), "tensor needs"},
		{"param out of range", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Param.Offset = segSize - 4 })), "outside"},
		{"param misaligned", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Param.Offset += 2 })), "not aligned"},
		{"param in unknown segment", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Param.Seg = 999 })), "unknown segment"},
		{"param in another client's segment", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Param = ipc.MemRef{Seg: other.id, Bytes: nb} })), "unknown segment"},
		{"invalid hyper", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Hyper.Beta1 = 1 })), "beta parameter"},
		{"bad shape", "c1", ipc.OpRegister, reg(newSpec(func(s *ipc.TensorSpec) { s.Shape = []int64{3, 0, 7} })), "out of range"},
		// export / import
		{"export unknown tensor", "c1", ipc.OpExport, xfer(999, func(*ipc.StateXfer) {}), "unknown tensor 999"},
		{"export parts overlap", "c1", ipc.OpExport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvgSq.Offset = x.ExpAvg.Offset + 4 }), "overlap"},
		{"export into the param", "c1", ipc.OpExport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvgSq = aParam }), "overlaps the parameter"},
		{"export amsgrad without max_exp_avg_sq", "c1", ipc.OpExport, xfer(C.id, func(x *ipc.StateXfer) {
			x.ExpAvg.Bytes, x.ExpAvgSq.Bytes = int64(C.nbytes()), int64(C.nbytes())
		}), "unknown segment 0"},
		{"export wrong size", "c1", ipc.OpExport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvg.Bytes -= 4 }), "tensor needs"},
		{"import unknown tensor", "c1", ipc.OpImport, xfer(999, func(*ipc.StateXfer) {}), "unknown tensor 999"},
		{"import negative step", "c1", ipc.OpImport, xfer(A.id, func(x *ipc.StateXfer) { x.Step = -1 }), "negative step"},
		{"import from the param", "c1", ipc.OpImport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvg = aParam }), "overlaps the parameter"},
		{"import parts overlap", "c1", ipc.OpImport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvgSq = x.ExpAvg }), "overlap"},
		{"import out of range", "c1", ipc.OpImport, xfer(A.id, func(x *ipc.StateXfer) { x.ExpAvgSq.Offset = segSize }), "outside"},
		// segments and the rest
		{"detach segment holding a tensor", "c1", ipc.OpDetach, ipc.Detach{Seg: w.params.id}, "cannot detach"},
		{"detach unknown segment", "c1", ipc.OpDetach, ipc.Detach{Seg: 999}, "unknown segment"},
		{"detach another client's segment", "c1", ipc.OpDetach, ipc.Detach{Seg: other.id}, "unknown segment"},
		{"attach bad name", "c1", ipc.OpAttach, ipc.Attach{Shm: "sonar-../x", Size: 4096}, "not allowed"},
		{"attach missing segment", "c1", ipc.OpAttach, ipc.Attach{Shm: "sonar-missing", Size: 4096}, "no such file"},
		{"attach zero size", "c1", ipc.OpAttach, ipc.Attach{Shm: "sonar-missing", Size: 0}, "positive size"},
		{"unknown op", "c1", "frobnicate", nil, "unknown op"},
	}
	for _, tc := range cases {
		before := w.snapshot()
		errsBefore := w.s.Stats().Errors
		_, err := w.call(tc.client, tc.op, tc.body)
		if err == nil {
			t.Errorf("%s: request succeeded", tc.name)
			continue
		}
		if !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: error %q does not contain %q", tc.name, err, tc.wantErr)
		}
		if !strings.HasPrefix(err.Error(), fmt.Sprintf("%s (request %d): ", tc.op, w.id)) {
			t.Errorf("%s: error %q does not name the op and request id", tc.name, err)
		}
		if diff := before.diff(w.snapshot()); diff != "" {
			t.Errorf("%s: failed request changed %s", tc.name, diff)
		}
		if got := w.s.Stats().Errors; got != errsBefore+1 {
			t.Errorf("%s: error count %d -> %d", tc.name, errsBefore, got)
		}
	}

	// Everything still works, and the pending micro-batch is intact.
	w.applyAll()
	if w.ts[1].mirror.Pending() != 0 || w.server(1).Pending() != 0 {
		t.Error("pending gradient not applied")
	}
}

func TestAccumulateThenApply(t *testing.T) {
	w := newWorld(t)
	w.applyAll()
	for _, last := range []string{"apply with a gradient", "apply what was accumulated"} {
		grads := make([][][]byte, len(w.ts)) // per tensor, the micro-batches
		// Two micro-batches accumulate, through the same slot: the client
		// reuses it as soon as the server has answered.
		for k := range 2 {
			var items []ipc.StepItem
			for i := range w.ts {
				ref := w.newGrad(i, 1)
				grads[i] = append(grads[i], w.gradBytes(ref))
				items = append(items, w.item(i, ref, false))
			}
			rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: items}).(ipc.StepReply)
			if rep.Accumulated != len(w.ts) || rep.Applied != 0 {
				t.Fatalf("accumulate reply %+v", rep)
			}
			for i := range w.ts {
				if w.server(i).Pending() != k+1 || w.server(i).Step != w.ts[i].mirror.Step {
					t.Fatalf("%s: pending %d step %d after %d accumulations", w.ts[i].name, w.server(i).Pending(), w.server(i).Step, k+1)
				}
			}
			w.checkMirrors() // accumulation changes no parameter or state
			// An export between micro-batches gives the state before their
			// step and leaves them pending.
			for i, ts := range w.ts {
				nb := int64(ts.nbytes())
				ref := func(k int) ipc.MemRef {
					return ipc.MemRef{Seg: w.state.id, Offset: int64(i)*4096 + int64(k)*1024, Bytes: nb}
				}
				x := ipc.StateXfer{Tensor: ts.id, ExpAvg: ref(0), ExpAvgSq: ref(1)}
				if ts.hyper.Amsgrad {
					x.MaxExpAvgSq = ref(2)
				}
				w.must(w.client, ipc.OpExport, x)
				got := w.state.mem[ref(0).Offset : ref(0).Offset+nb]
				if !bytes.Equal(got, ts.mirror.ExpAvg) || w.server(i).Pending() != k+1 {
					t.Fatalf("%s: export between micro-batches: state equal %v, pending %d", ts.name,
						bytes.Equal(got, ts.mirror.ExpAvg), w.server(i).Pending())
				}
				// An import between them sets the state their step starts from
				// (here the same state, with the step count too) and keeps them.
				x.Step = ts.mirror.Step
				w.must(w.client, ipc.OpImport, x)
				if w.server(i).Pending() != k+1 || w.server(i).Step != ts.mirror.Step {
					t.Fatalf("%s: import between micro-batches: pending %d step %d", ts.name, w.server(i).Pending(), w.server(i).Step)
				}
			}
		}
		var items []ipc.StepItem
		for i := range w.ts {
			ref := ipc.MemRef{}
			if last == "apply with a gradient" {
				ref = w.newGrad(i, 2)
				grads[i] = append(grads[i], w.gradBytes(ref))
			}
			items = append(items, w.item(i, ref, true))
		}
		rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: items}).(ipc.StepReply)
		if rep.Applied != len(w.ts) {
			t.Fatalf("%s: reply %+v", last, rep)
		}
		// The engine, given the sum of the micro-batches in the dtype.
		for i, ts := range w.ts {
			sum := grads[i][0]
			for _, g := range grads[i][1:] {
				if ts.dtype == optimizer.Float32 {
					s, x := optimizer.F32s(sum), optimizer.F32s(g)
					for j := range s {
						s[j] = float32(s[j] + x[j])
					}
				} else {
					s, x := optimizer.U16s(sum), optimizer.U16s(g)
					for j := range s {
						s[j] = optimizer.F32ToBF16(float32(optimizer.BF16ToF32(s[j]) + optimizer.BF16ToF32(x[j])))
					}
				}
			}
			if err := w.mirrorEngine.Apply(ts.mirror, sum, optimizer.ScalarsFor(ts.hyper, ts.mirror.Step+1)); err != nil {
				t.Fatal(err)
			}
		}
		w.checkMirrors()
	}
}

// TestMaximizeIsPerStep: torch.optim.AdamW reads a group's maximize at each
// step, so a script may toggle it; the server takes it from each step item,
// whatever the registration said. A tensor registered with maximize=false and
// one registered with maximize=true, stepped with the same gradients and
// scalars (maximize on, off, on, with one accumulated step), end bitwise equal
// to each other and to the engine stepped directly with those scalars, on the
// single-tensor and the fused CPU arithmetic.
func TestMaximizeIsPerStep(t *testing.T) {
	flags := []bool{true, false, true, true, false}
	const accumulatedStep = 3 // 0-based: this step's gradient comes in two micro-batches
	cases := []struct {
		name    string
		dtype   optimizer.DType
		amsgrad bool
		fused   bool
		lanes   int
	}{
		{"float32 single-tensor", optimizer.Float32, false, false, 0},
		{"bfloat16 single-tensor", optimizer.BFloat16, false, false, 0},
		{"float32 single-tensor amsgrad", optimizer.Float32, true, false, 0},
		{"float32 fused", optimizer.Float32, false, true, 8},
		{"bfloat16 fused", optimizer.BFloat16, false, true, 16},
		{"bfloat16 fused amsgrad, no lanes", optimizer.BFloat16, true, true, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			const client = "c1"
			params, grads := h.newSegment("sonar-params", segSize), h.newSegment("sonar-grads", segSize)
			h.attach(client, params)
			h.attach(client, grads)
			const numel = 37 // not a multiple of the fused kernel's lanes: its scalar tail runs too
			nb := numel * tc.dtype.Size()
			fill := func(seg *testSegment, off int, sd float64) {
				if tc.dtype == optimizer.BFloat16 {
					h.fillBF16(seg, off, numel, sd)
				} else {
					h.fillF32(seg, off, numel, sd)
				}
			}
			fill(params, 0, 1)
			copy(params.mem[1024:1024+nb], params.mem[:nb])
			base := optimizer.Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: tc.amsgrad}
			maxHyper := base
			maxHyper.Maximize = true
			spec := func(name string, off int, hy optimizer.Hyper) ipc.TensorSpec {
				return ipc.TensorSpec{Name: name, Shape: []int64{numel}, DType: tc.dtype.String(),
					Param: ipc.MemRef{Seg: params.id, Offset: int64(off), Bytes: int64(nb)}, Hyper: hyperMsg(hy)}
			}
			ids := h.must(client, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
				spec("registered-min", 0, base), spec("registered-max", 1024, maxHyper)}}).(ipc.RegisterReply).IDs
			eng := &optimizer.Engine{Workers: 1}
			mirror, err := optimizer.NewTensor("mirror", tc.dtype, numel, base, bytes.Clone(params.mem[:nb]))
			if err != nil {
				t.Fatal(err)
			}
			never, err := optimizer.NewTensor("never-maximize", tc.dtype, numel, base, bytes.Clone(params.mem[:nb]))
			if err != nil {
				t.Fatal(err)
			}
			server := func(k int) *optimizer.Tensor { return engineTensor(h.s.sessions[client].tensors[ids[k]]) }
			grad := func(slot int) (ipc.MemRef, []byte) {
				off := slot * 1024
				fill(grads, off, 1e-2)
				return ipc.MemRef{Seg: grads.id, Offset: int64(off), Bytes: int64(nb)}, bytes.Clone(grads.mem[off : off+nb])
			}
			for i, maximize := range flags {
				step := int64(i + 1)
				sc := optimizer.ScalarsFor(base, step)
				sc.Maximize, sc.Fused, sc.Lanes = maximize, tc.fused, tc.lanes
				msg := scalarsMsg(sc)
				msg.Fused, msg.Lanes = tc.fused, tc.lanes
				if i == accumulatedStep {
					ref, g := grad(1)
					h.must(client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{
						{Tensor: ids[0], Grad: ref, Step: step, Scalars: msg},
						{Tensor: ids[1], Grad: ref, Step: step, Scalars: msg}}})
					if err := eng.Accumulate(mirror, g); err != nil {
						t.Fatal(err)
					}
				}
				ref, g := grad(0)
				rep := h.must(client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{
					{Tensor: ids[0], Grad: ref, Apply: true, Step: step, Scalars: msg},
					{Tensor: ids[1], Grad: ref, Apply: true, Step: step, Scalars: msg}}}).(ipc.StepReply)
				if rep.Applied != 2 {
					t.Fatalf("step %d: reply %+v", step, rep)
				}
				if err := eng.Apply(mirror, g, sc); err != nil {
					t.Fatal(err)
				}
				if i == 0 {
					neverSc := sc
					neverSc.Maximize = false
					if err := eng.Apply(never, g, neverSc); err != nil {
						t.Fatal(err)
					}
					if bytes.Equal(never.Param, params.mem[:nb]) {
						t.Fatalf("step %d: maximize=%v gave the parameter of maximize=false", step, maximize)
					}
				}
				for k, name := range []string{"registered with maximize=false", "registered with maximize=true"} {
					st := server(k)
					param := params.mem[k*1024 : k*1024+nb]
					if !bytes.Equal(param, mirror.Param) {
						t.Fatalf("step %d (maximize=%v): %s: param differs from the engine's", step, maximize, name)
					}
					if st.Step != step || st.Pending() != 0 || !bytes.Equal(st.ExpAvg, mirror.ExpAvg) ||
						!bytes.Equal(st.ExpAvgSq, mirror.ExpAvgSq) || !bytes.Equal(st.MaxExpAvgSq, mirror.MaxExpAvgSq) {
						t.Fatalf("step %d (maximize=%v): %s: state differs from the engine's", step, maximize, name)
					}
				}
			}
		})
	}
}

func TestExportImportRoundTrip(t *testing.T) {
	w := newWorld(t)
	w.applyAll()
	w.applyAll()
	for i, ts := range w.ts {
		nb := int64(ts.nbytes())
		base := int64(i) * 4096
		ref := func(k int) ipc.MemRef { return ipc.MemRef{Seg: w.state.id, Offset: base + int64(k)*1024, Bytes: nb} }
		x := ipc.StateXfer{Tensor: ts.id, ExpAvg: ref(0), ExpAvgSq: ref(1)}
		if ts.hyper.Amsgrad {
			x.MaxExpAvgSq = ref(2)
		}
		rep := w.must(w.client, ipc.OpExport, x).(ipc.ExportReply)
		if rep.Step != 2 || rep.Amsgrad != ts.hyper.Amsgrad {
			t.Errorf("%s: export reply %+v", ts.name, rep)
		}
		st := w.server(i)
		part := func(k int) []byte { r := ref(k); return w.state.mem[r.Offset : r.Offset+nb] }
		if !bytes.Equal(part(0), st.ExpAvg) || !bytes.Equal(part(1), st.ExpAvgSq) ||
			(ts.hyper.Amsgrad && !bytes.Equal(part(2), st.MaxExpAvgSq)) {
			t.Fatalf("%s: exported state differs from the server's", ts.name)
		}

		// A new tensor with the same parameter, importing that state,
		// steps exactly like the original.
		clone := *ts
		clone.name = ts.name + ".clone"
		clone.off = 8192 + i*1024
		cloneParam := w.params.mem[clone.off : clone.off+ts.nbytes()]
		copy(cloneParam, w.param(i))
		regRep := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{clone.spec(w.params)}}).(ipc.RegisterReply)
		x.Tensor = regRep.IDs[0]
		x.Step = rep.Step
		if imp := w.must(w.client, ipc.OpImport, x).(ipc.ExportReply); imp.Step != 2 || imp.Amsgrad != ts.hyper.Amsgrad {
			t.Errorf("%s: import reply %+v", ts.name, imp)
		}
		cl := engineTensor(w.s.sessions[w.client].tensors[regRep.IDs[0]])
		if cl.Step != st.Step || !bytes.Equal(cl.ExpAvg, st.ExpAvg) || !bytes.Equal(cl.ExpAvgSq, st.ExpAvgSq) || !bytes.Equal(cl.MaxExpAvgSq, st.MaxExpAvgSq) {
			t.Fatalf("%s: imported state differs", ts.name)
		}
		// Import copies: changing the shared memory afterwards changes nothing.
		part(0)[0] ^= 0x40
		if bytes.Equal(cl.ExpAvg, part(0)) {
			t.Fatalf("%s: imported state aliases the shared memory", ts.name)
		}

		g := w.newGrad(i, 1)
		it := w.item(i, g, true)
		it2 := it
		it2.Tensor = regRep.IDs[0]
		w.must(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{it, it2}})
		if err := w.mirrorEngine.Apply(ts.mirror, w.gradBytes(g), optimizer.ScalarsFor(ts.hyper, 3)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(w.param(i), cloneParam) {
			t.Errorf("%s: clone stepped differently", ts.name)
		}
		if cl.Step != 3 || !bytes.Equal(cl.ExpAvg, w.server(i).ExpAvg) {
			t.Errorf("%s: clone state differs after a step", ts.name)
		}
	}
	w.checkMirrors()

	// Import replaces a state: step 0 with zero moments restarts the tensor.
	zero := ipc.MemRef{Seg: w.state.id, Offset: 12288, Bytes: int64(w.ts[0].nbytes())}
	clear(w.state.mem[zero.Offset : zero.Offset+zero.Bytes])
	zero2 := zero
	zero2.Offset += 1024
	clear(w.state.mem[zero2.Offset : zero2.Offset+zero2.Bytes])
	w.must(w.client, ipc.OpImport, ipc.StateXfer{Tensor: w.ts[0].id, Step: 0, ExpAvg: zero, ExpAvgSq: zero2})
	if st := w.server(0); st.Step != 0 || bytes.Count(st.ExpAvg, []byte{0}) != len(st.ExpAvg) {
		t.Error("import of a zero state did not reset the tensor")
	}
}

func TestDetachAndBye(t *testing.T) {
	w := newWorld(t)
	w.applyAll()
	extra := w.newSegment("sonar-extra", 8192)
	w.attach(w.client, extra)
	if _, err := w.call(w.client, ipc.OpDetach, ipc.Detach{Seg: w.params.id}); err == nil || !strings.Contains(err.Error(), "cannot detach") {
		t.Errorf("detach of the param segment: %v", err)
	}
	if st := w.s.Stats(); st.Segments != 4 {
		t.Errorf("%d segments", st.Segments)
	}
	// A segment holding only gradients can go; then it is unknown.
	w.must(w.client, ipc.OpDetach, ipc.Detach{Seg: extra.id})
	if st := w.s.Stats(); st.Segments != 3 {
		t.Errorf("%d segments after detach", st.Segments)
	}
	if _, err := w.call(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{w.item(0, ipc.MemRef{Seg: extra.id, Bytes: int64(w.ts[0].nbytes())}, true)}}); err == nil ||
		!strings.Contains(err.Error(), "unknown segment") {
		t.Errorf("step with a detached segment: %v", err)
	}
	if _, err := w.call(w.client, ipc.OpDetach, ipc.Detach{Seg: extra.id}); err == nil {
		t.Error("second detach succeeded")
	}

	// Bye releases the session: no tensors, segments or sessions left; the
	// client's own mapping stays valid.
	if rep := w.must(w.client, ipc.OpBye, nil); rep == nil {
		t.Error("bye: no reply body")
	}
	st := w.s.Stats()
	if st.Tensors != 0 || st.Segments != 0 || st.Sessions != 0 || st.StateBytes != 0 || st.SegmentBytes != 0 {
		t.Errorf("stats after bye %+v", st)
	}
	w.params.mem[0] ^= 1
	// The tensor ids are gone with the session.
	if _, err := w.call(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: w.ts[0].id, Grad: ipc.MemRef{Seg: w.grads.id, Bytes: 4}, Apply: true, Step: 2, Scalars: scalarsMsg(optimizer.ScalarsFor(w.ts[0].hyper, 2))}}}); err == nil ||
		!strings.Contains(err.Error(), "unknown tensor") {
		t.Errorf("step after bye: %v", err)
	}
	// A second bye is harmless.
	w.must(w.client, ipc.OpBye, nil)

	// Shutdown releases the session and closes Done, once.
	select {
	case <-w.s.Done():
		t.Fatal("Done closed before shutdown")
	default:
	}
	for _, body := range []any{nil, ipc.Shutdown{}, ipc.Shutdown{Token: "guess"}} {
		if _, err := w.call("c3", ipc.OpShutdown, body); err == nil || !strings.Contains(err.Error(), "not allowed") {
			t.Errorf("shutdown without a token (%v, none set): %v", body, err)
		}
		w.s.AdminToken = "secret"
	}
	w.must("c3", ipc.OpShutdown, ipc.Shutdown{Token: "secret"})
	w.must("c3", ipc.OpShutdown, ipc.Shutdown{Token: "secret"})
	select {
	case <-w.s.Done():
	default:
		t.Error("Done not closed by shutdown")
	}
}
