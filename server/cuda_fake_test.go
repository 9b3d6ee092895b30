package server

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/backend/cpu"
	"github.com/sonar-moe/sonar/backend/gpu"
	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/cuda/cudatest"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer/device"
	"go.uber.org/zap"
)

// cudaWorld is a server with the CPU backend and a CUDA backend on the
// stand-in driver of cuda/cudatest (device memory is host memory there;
// kernels do not run but their launches are recorded), and a client's
// device allocations: parameters, gradients and a state-transfer area.
type cudaWorld struct {
	*harness
	f                   *cudatest.Fake
	dev                 *cuda.Device
	params, grads, xfer cuda.DevicePtr
	seg                 map[cuda.DevicePtr]uint32
}

const cudaAlloc = 8192

func newCUDAWorld(t *testing.T) *cudaWorld {
	f := cudatest.Driver(t)
	drv, err := cuda.OpenLibrary(f.Path)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := drv.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	k, err := device.LoadPTX(dev, []byte("// placeholder PTX\x00"), 90)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := device.NewEngineWith(dev, k)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s := New(zap.NewNop(), &cpu.Backend{Mapper: ipcbridge.ShmMapper{Dir: dir, Unlink: true}, Workers: 1}, gpu.New(dev, eng, 1))
	t.Cleanup(s.Close) // runs last: closes the backends and the device
	w := &cudaWorld{harness: &harness{t: t, dir: dir, s: s, rng: rand.New(rand.NewPCG(3, 4))}, f: f, dev: dev,
		seg: map[cuda.DevicePtr]uint32{}}
	for _, p := range []*cuda.DevicePtr{&w.params, &w.grads, &w.xfer} {
		if *p, err = dev.Alloc(cudaAlloc); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, cudaAlloc)
		for i := range b {
			b[i] = byte(w.rng.IntN(256))
		}
		if err := dev.CopyHtoD(*p, b); err != nil {
			t.Fatal(err)
		}
		ptr := *p
		t.Cleanup(func() { _ = dev.Free(ptr) })
	}
	return w
}

// attachCUDA attaches allocation p as the client would, by its IPC handle.
func (w *cudaWorld) attachCUDA(client string, p cuda.DevicePtr) uint32 {
	h, err := w.dev.IPCMemHandle(p)
	if err != nil {
		w.t.Fatal(err)
	}
	rep := w.must(client, ipc.OpAttachCUDA, ipc.AttachCUDA{Handle: h.Reserved[:], Size: cudaAlloc}).(ipc.AttachReply)
	w.seg[p] = rep.Seg
	return rep.Seg
}

func (w *cudaWorld) read(p cuda.DevicePtr, off, n int64) []byte {
	b := make([]byte, n)
	if err := w.dev.CopyDtoH(b, p+cuda.DevicePtr(off)); err != nil {
		w.t.Fatal(err)
	}
	return b
}

// TestCUDAPathOnStandInDriver drives the server's CUDA path end to end on
// the stand-in driver: IPC opens and closes, event order, the launch
// descriptors the kernels receive, state allocation, transfer and release,
// and refusals that change nothing.
func TestCUDAPathOnStandInDriver(t *testing.T) {
	w := newCUDAWorld(t)
	baseAllocs := w.f.State(cudatest.LiveAllocs)
	opened, closed := w.f.State(cudatest.IPCOpened), w.f.State(cudatest.IPCClosed)
	const c = "client"
	hello := w.must(c, ipc.OpHello, ipc.Hello{Client: "test", PID: 0}).(ipc.HelloReply)
	if hello.CUDA != "Fake H200, cc 9.0, compute_90, scalar loads" || hello.Sqrt != "ieee" {
		t.Errorf("hello %+v", hello)
	}
	pSeg, gSeg, xSeg := w.attachCUDA(c, w.params), w.attachCUDA(c, w.grads), w.attachCUDA(c, w.xfer)
	if got := w.f.State(cudatest.IPCOpened) - opened; got != 3 {
		t.Errorf("%d IPC opens for 3 allocations", got)
	}
	evh := make([]byte, 64)
	w.must(c, ipc.OpCUDAEvent, ipc.CUDAEvent{Handle: evh})

	hyper := ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	ams := hyper
	ams.Amsgrad = true
	reg := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
		{Name: "w1", Shape: []int64{4, 64}, DType: "float32", Param: ipc.MemRef{Seg: pSeg, Offset: 0, Bytes: 1024}, Hyper: ams},
		{Name: "w2", Shape: []int64{101}, DType: "bfloat16", Param: ipc.MemRef{Seg: pSeg, Offset: 1024, Bytes: 202}, Hyper: hyper},
	}}).(ipc.RegisterReply)
	if got := w.f.State(cudatest.LiveAllocs) - baseAllocs; got != 5 {
		t.Errorf("%d device allocations for the state of an amsgrad and a plain tensor, want 5", got)
	}
	st := w.s.Stats()
	if st.DeviceStateBytes != 3*1024+2*202 || st.DeviceSegments != 3 || st.Tensors != 2 || st.StateBytes != 0 {
		t.Errorf("stats after register: %+v", st)
	}

	sc := ipc.ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-3, BC2Sqrt: 0.0316, Eps: 1e-8}
	scAms := sc
	scAms.Amsgrad = true
	items := []ipc.StepItem{
		{Tensor: reg.IDs[0], Grad: ipc.MemRef{Seg: gSeg, Offset: 0, Bytes: 1024}, Apply: true, Step: 1, Scalars: scAms},
		{Tensor: reg.IDs[1], Grad: ipc.MemRef{Seg: gSeg, Offset: 2048, Bytes: 202}, Apply: true, Step: 1, Scalars: sc},
	}
	w.f.ClearLog()
	rep := w.must(c, ipc.OpStep, ipc.Step{Items: items, WaitEvent: true}).(ipc.StepReply)
	if rep.Applied != 2 || rep.Bytes != 1226 {
		t.Errorf("step reply %+v", rep)
	}
	if got := strings.TrimSpace(w.f.Log()); got != "wait launch launch record sync" {
		t.Errorf("stream operations %q: the kernels must wait for the client's event and finish before the reply", got)
	}
	// The last launch is the bfloat16 batch: one descriptor naming the
	// client's parameter and gradient and the server's state.
	var dims [7]uint32
	var stream uintptr
	param := make([]byte, 88)
	w.f.Launch(&dims, &stream, &param[0], int32(len(param)))
	le := binary.LittleEndian
	if p, g, m, v := le.Uint64(param[0:]), le.Uint64(param[8:]), le.Uint64(param[16:]), le.Uint64(param[24:]); p != uint64(w.params)+1024 ||
		g != uint64(w.grads)+2048 || m == 0 || v == 0 || m == v {
		t.Errorf("descriptor: param %#x grad %#x m %#x v %#x (client param %#x grad %#x)", p, g, m, v, uint64(w.params), uint64(w.grads))
	}
	if n := le.Uint64(param[40:]); n != 101 {
		t.Errorf("descriptor numel %d", n)
	}
	if got := strings.TrimSpace(w.f.Kernels()); got != "sonar_adamw_f32 sonar_adamw_bf16" {
		t.Errorf("foreach step launched %q, want the foreach kernels", got)
	}

	// A fused step (AdamW(fused=True)) launches the fused kernels with the
	// hyper-parameters and the step count; a request may mix both kinds.
	fused := func(s ipc.ScalarsMsg) ipc.ScalarsMsg {
		s.Fused, s.LR, s.Beta1, s.WeightDecay = true, 1e-3, 0.9, 0.01
		s.Beta1W, s.Decay = 1-s.Beta1, 1-s.LR*s.WeightDecay
		return s
	}
	items2 := []ipc.StepItem{
		{Tensor: reg.IDs[0], Grad: ipc.MemRef{Seg: gSeg, Offset: 0, Bytes: 1024}, Apply: true, Step: 2, Scalars: scAms},
		{Tensor: reg.IDs[1], Grad: ipc.MemRef{Seg: gSeg, Offset: 2048, Bytes: 202}, Apply: true, Step: 2, Scalars: fused(sc)},
	}
	w.f.ClearLog()
	w.must(c, ipc.OpStep, ipc.Step{Items: items2, WaitEvent: true})
	if got := strings.TrimSpace(w.f.Kernels()); got != "sonar_adamw_f32 sonar_fused_adamw_bf16" {
		t.Errorf("foreach f32 + fused bf16 step launched %q", got)
	}
	w.f.Launch(&dims, &stream, &param[0], int32(len(param)))
	f32at := func(off int) float32 { return math.Float32frombits(le.Uint32(param[off:])) }
	if p := le.Uint64(param[0:]); p != uint64(w.params)+1024 || f32at(56) != float32(1e-3) || f32at(60) != 0.9 ||
		f32at(64) != 0.999 || f32at(68) != 0.01 || f32at(72) != float32(1e-8) || f32at(76) != 2 || le.Uint32(param[84:])&1 == 0 {
		t.Errorf("fused descriptor: param %#x lr %v beta1 %v beta2 %v wd %v eps %v step %v flags %#x", p,
			f32at(56), f32at(60), f32at(64), f32at(68), f32at(72), f32at(76), le.Uint32(param[84:]))
	}
	items[0].Step, items[1].Step = 3, 3
	items[0].Scalars = fused(scAms)
	w.f.ClearLog()
	w.must(c, ipc.OpStep, ipc.Step{Items: items, WaitEvent: true})
	if got := strings.TrimSpace(w.f.Kernels()); got != "sonar_fused_adamw_f32 sonar_adamw_bf16" {
		t.Errorf("fused f32 + foreach bf16 step launched %q", got)
	}
	// torch 2.8-2.10's fused arithmetic (fused_double): its own kernels, the doubles in the descriptor.
	items[0].Step, items[1].Step = 4, 4
	items[1].Scalars = fused(sc)
	items[1].Scalars.FusedDouble = true
	w.f.ClearLog()
	w.must(c, ipc.OpStep, ipc.Step{Items: items, WaitEvent: true})
	if got := strings.TrimSpace(w.f.Kernels()); got != "sonar_fused_adamw_f32 sonar_fused64_adamw_bf16" {
		t.Errorf("fused f32 + fused double bf16 step launched %q", got)
	}
	p104 := make([]byte, 104)
	w.f.Launch(&dims, &stream, &p104[0], int32(len(p104)))
	f64at := func(off int) float64 { return math.Float64frombits(le.Uint64(p104[off:])) }
	if f64at(56) != 1e-3 || f64at(64) != 0.9 || f64at(72) != 0.999 || f64at(80) != 0.01 || f64at(88) != 1e-8 ||
		math.Float32frombits(le.Uint32(p104[96:])) != 4 || le.Uint32(p104[100:])&1 == 0 {
		t.Errorf("fused double descriptor: %v %v %v %v %v step %v flags %#x", f64at(56), f64at(64), f64at(72), f64at(80),
			f64at(88), math.Float32frombits(le.Uint32(p104[96:])), le.Uint32(p104[100:]))
	}
	items[1].Scalars = sc
	bad := items[0]
	bad.Step = 5
	bad.Scalars.LR = 0 // a client that sent only the CPU kernel's fused scalars
	launches0 := w.f.State(cudatest.Launches)
	if _, err := w.call(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{bad}}); err == nil || !strings.Contains(err.Error(), "needs the step's lr") {
		t.Errorf("fused step without lr: %v", err)
	}
	if w.f.State(cudatest.Launches) != launches0 {
		t.Error("a refused fused step launched a kernel")
	}
	items[0].Scalars = scAms

	// Refusals: nothing is queued, no step advances.
	shm := w.newSegment("sonar-cpu", 4096)
	w.attach(c, shm)
	cpuReg := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "cpu", Shape: []int64{8}, DType: "float32",
		Param: ipc.MemRef{Seg: shm.id, Bytes: 32}, Hyper: hyper}}}).(ipc.RegisterReply)
	launches := w.f.State(cudatest.Launches)
	mod := func(f func(*ipc.StepItem)) ipc.StepItem { it := items[0]; it.Step = 5; f(&it); return it }
	for _, tc := range []struct {
		name string
		step ipc.Step
		want string
	}{
		{"CPU and CUDA tensors in one request", ipc.Step{Items: []ipc.StepItem{mod(func(*ipc.StepItem) {}),
			{Tensor: cpuReg.IDs[0], Grad: ipc.MemRef{Seg: shm.id, Offset: 1024, Bytes: 32}, Apply: true, Step: 1, Scalars: sc}}}, "one kind"},
		{"gradient in shared memory", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Grad = ipc.MemRef{Seg: shm.id, Offset: 1024, Bytes: 1024} })}},
			"is cpu memory, the tensor is cuda memory"},
		{"gradient overlaps the parameter", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Grad = ipc.MemRef{Seg: pSeg, Offset: 512, Bytes: 1024} })}},
			"overlaps the parameter"},
		{"gradient outside the allocation", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Grad.Offset = cudaAlloc - 512 })}},
			"outside its"},
		{"wrong step", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Step = 7 })}}, "client step 7 but server is at step 4"},
		{"amsgrad differs", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Scalars.Amsgrad = false })}},
			"amsgrad differs from registration (registered amsgrad=true)"},
		{"nothing accumulated", ipc.Step{Items: []ipc.StepItem{mod(func(it *ipc.StepItem) { it.Grad = ipc.MemRef{} })}}, "nothing accumulated"},
	} {
		if _, err := w.call(c, ipc.OpStep, tc.step); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.name, err, tc.want)
		}
	}
	if _, err := w.call("other", ipc.OpStep, ipc.Step{Items: []ipc.StepItem{items[0]}, WaitEvent: true}); err == nil ||
		!strings.Contains(err.Error(), "unknown tensor") {
		t.Errorf("another client's tensor: %v", err)
	}
	if _, err := w.call(c, ipc.OpDetach, ipc.Detach{Seg: pSeg}); err == nil || !strings.Contains(err.Error(), "holds tensor") {
		t.Errorf("detach of a segment holding tensors: %v", err)
	}
	if got := w.f.State(cudatest.Launches); got != launches {
		t.Errorf("refused steps launched %d kernels", got-launches)
	}

	// Import random state, export it elsewhere: the bytes and the step come back.
	ref := func(off int64, n int64) ipc.MemRef { return ipc.MemRef{Seg: xSeg, Offset: off, Bytes: n} }
	x := ipc.StateXfer{Tensor: reg.IDs[0], Step: 9, ExpAvg: ref(0, 1024), ExpAvgSq: ref(1024, 1024), MaxExpAvgSq: ref(2048, 1024)}
	if r := w.must(c, ipc.OpImport, x).(ipc.ExportReply); r.Step != 9 || !r.Amsgrad {
		t.Errorf("import reply %+v", r)
	}
	want := w.read(w.xfer, 0, 3072)
	x = ipc.StateXfer{Tensor: reg.IDs[0], ExpAvg: ref(4096, 1024), ExpAvgSq: ref(5120, 1024), MaxExpAvgSq: ref(6144, 1024)}
	if r := w.must(c, ipc.OpExport, x).(ipc.ExportReply); r.Step != 9 {
		t.Errorf("export reply %+v", r)
	}
	if got := w.read(w.xfer, 4096, 3072); !bytes.Equal(got, want) {
		t.Error("exported state differs from the imported one")
	}
	x.MaxExpAvgSq = ref(4608, 1024)
	if _, err := w.call(c, ipc.OpExport, x); err == nil || !strings.Contains(err.Error(), "state parts 0 and 2 overlap") {
		t.Errorf("overlapping state parts: %v", err)
	}

	// Goodbye frees every device buffer and closes every IPC mapping.
	w.must(c, ipc.OpBye, nil)
	if got := w.f.State(cudatest.LiveAllocs); got != baseAllocs {
		t.Errorf("%d device allocations left after bye", got-baseAllocs)
	}
	st = w.s.Stats()
	if st.DeviceStateBytes != 0 || st.DeviceSegments != 0 || st.Tensors != 0 || st.IPCOpen > 1 {
		t.Errorf("stats after bye: %+v", st)
	}
	if w.f.State(cudatest.IPCClosed)-closed < 2 {
		t.Errorf("IPC closes %d: the cache keeps at most 1 idle allocation", w.f.State(cudatest.IPCClosed)-closed)
	}
}

// TestCUDAMaximizeIsPerStep: on the CUDA path too maximize is each step
// item's, not the registration's: the kernel descriptor's maximize flag
// follows the item, for the foreach, fused and fused-double kernels, for
// tensors registered with maximize false and true.
func TestCUDAMaximizeIsPerStep(t *testing.T) {
	w := newCUDAWorld(t)
	const c = "client"
	w.must(c, ipc.OpHello, ipc.Hello{Client: "test", PID: 0})
	pSeg, gSeg := w.attachCUDA(c, w.params), w.attachCUDA(c, w.grads)
	hyper := ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	maxHyper := hyper
	maxHyper.Maximize = true
	reg := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
		{Name: "registered-min", Shape: []int64{64}, DType: "float32", Param: ipc.MemRef{Seg: pSeg, Offset: 0, Bytes: 256}, Hyper: hyper},
		{Name: "registered-max", Shape: []int64{64}, DType: "float32", Param: ipc.MemRef{Seg: pSeg, Offset: 1024, Bytes: 256}, Hyper: maxHyper},
	}}).(ipc.RegisterReply)
	sc := ipc.ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-3, BC2Sqrt: 0.0316, Eps: 1e-8}
	kinds := map[string]struct {
		kernel  string
		flagsAt int // of the descriptor's flags (optimizer/device: offFlags, off64Flags)
		scalars func(ipc.ScalarsMsg) ipc.ScalarsMsg
	}{
		"foreach": {"sonar_adamw_f32", 84, func(s ipc.ScalarsMsg) ipc.ScalarsMsg { return s }},
		"fused": {"sonar_fused_adamw_f32", 84, func(s ipc.ScalarsMsg) ipc.ScalarsMsg {
			s.Fused, s.LR, s.Beta1, s.WeightDecay = true, 1e-3, 0.9, 0.01
			s.Beta1W, s.Decay = 1-s.Beta1, 1-s.LR*s.WeightDecay
			return s
		}},
		"fused double": {"sonar_fused64_adamw_f32", 100, func(s ipc.ScalarsMsg) ipc.ScalarsMsg {
			s.Fused, s.FusedDouble, s.LR, s.Beta1, s.WeightDecay = true, true, 1e-3, 0.9, 0.01
			s.Beta1W, s.Decay = 1-s.Beta1, 1-s.LR*s.WeightDecay
			return s
		}},
	}
	const flagMaximize = 4 // optimizer/device's flag bit
	steps := make([]int64, len(reg.IDs))
	for _, tc := range []struct {
		name     string
		tensor   int // 0: registered with maximize=false, 1: with maximize=true
		kind     string
		maximize bool
	}{
		{"registered min, foreach maximize", 0, "foreach", true},
		{"registered min, foreach back to min", 0, "foreach", false},
		{"registered min, fused maximize", 0, "fused", true},
		{"registered min, fused double maximize", 0, "fused double", true},
		{"registered min, fused double back to min", 0, "fused double", false},
		{"registered max, foreach minimize", 1, "foreach", false},
		{"registered max, foreach back to max", 1, "foreach", true},
		{"registered max, fused minimize", 1, "fused", false},
		{"registered max, fused double minimize", 1, "fused double", false},
	} {
		k := kinds[tc.kind]
		s := k.scalars(sc)
		s.Maximize = tc.maximize
		steps[tc.tensor]++
		it := ipc.StepItem{Tensor: reg.IDs[tc.tensor], Grad: ipc.MemRef{Seg: gSeg, Offset: 0, Bytes: 256}, Apply: true,
			Step: steps[tc.tensor], Scalars: s}
		w.f.ClearLog()
		if _, err := w.call(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{it}}); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := strings.TrimSpace(w.f.Kernels()); got != k.kernel {
			t.Errorf("%s: launched %q, want %q", tc.name, got, k.kernel)
		}
		var dims [7]uint32
		var stream uintptr
		desc := make([]byte, k.flagsAt+4)
		w.f.Launch(&dims, &stream, &desc[0], int32(len(desc)))
		if p := binary.LittleEndian.Uint64(desc[0:]); p != uint64(w.params)+uint64(tc.tensor)*1024 {
			t.Errorf("%s: descriptor of param %#x, want the tensor's %#x", tc.name, p, uint64(w.params)+uint64(tc.tensor)*1024)
		}
		if got := binary.LittleEndian.Uint32(desc[k.flagsAt:])&flagMaximize != 0; got != tc.maximize {
			t.Errorf("%s: descriptor's maximize flag %v, want the item's %v", tc.name, got, tc.maximize)
		}
	}
}

// TestStateBudgetCountsHostMemoryOnly: the server's state budgets bound the
// host memory it holds; state and accumulation buffers on a device are the
// device allocator's to refuse. With a budget smaller than the device
// tensors' state, they register and accumulate, and the stats report them
// as device memory; host tensors of the same server are still refused.
func TestStateBudgetCountsHostMemoryOnly(t *testing.T) {
	w := newCUDAWorld(t)
	const budget = 1024 // bytes: less than the device tensor's 2 KiB of state and its 1 KiB accumulation buffer
	w.s.MaxStateBytes, w.s.MaxSessionStateBytes = budget, budget
	const c = "client"
	w.must(c, ipc.OpHello, ipc.Hello{Client: "test", PID: 0})
	pSeg, gSeg := w.attachCUDA(c, w.params), w.attachCUDA(c, w.grads)
	hyper := ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}
	reg := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
		{Name: "dev", Shape: []int64{256}, DType: "float32", Param: ipc.MemRef{Seg: pSeg, Offset: 0, Bytes: 1024}, Hyper: hyper},
	}}).(ipc.RegisterReply)
	w.must(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{
		{Tensor: reg.IDs[0], Grad: ipc.MemRef{Seg: gSeg, Offset: 0, Bytes: 1024}}}}) // a first micro-batch
	if st := w.s.Stats(); st.DeviceStateBytes != 3*1024 || st.StateBytes != 0 || st.Segments != 0 || st.DeviceSegments != 2 {
		t.Errorf("stats with a device tensor accumulating: %+v", st)
	}

	host := w.newSegment("sonar-host", 8192)
	w.attach(c, host)
	_, err := w.call(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
		{Name: "host", Shape: []int64{512}, DType: "float32", Param: ipc.MemRef{Seg: host.id, Offset: 0, Bytes: 2048}, Hyper: hyper},
	}})
	if err == nil || !strings.Contains(err.Error(), "over the memory budget") || !strings.Contains(err.Error(), "holds 0 B") {
		t.Errorf("host tensor whose 4 KiB of state pass a 1 KiB budget: %v", err)
	}
	if st := w.s.Stats(); st.Tensors != 1 || st.StateBytes != 0 || st.Segments != 1 || st.SegmentBytes != 8192 {
		t.Errorf("stats after the refused host register: %+v", st)
	}
}
