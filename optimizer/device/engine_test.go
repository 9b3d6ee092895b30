package device

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/cuda/cudatest"
	"github.com/sonar-moe/sonar/optimizer"
)

// testNVRTC loads NVRTC from the usual places or the repository's virtual
// environment; tests that need it are skipped where there is none.
func testNVRTC(t *testing.T) *cuda.NVRTC {
	t.Helper()
	wd, _ := os.Getwd()
	nv, err := cuda.OpenNVRTCFrom(append(cudatest.NVRTCPaths(wd), cuda.NVRTCCandidates()...))
	if err != nil {
		t.Skipf("no NVRTC on this machine: %v", err)
	}
	return nv
}

// fakeDevice opens device 0 of the stand-in driver.
func fakeDevice(t *testing.T) (*cuda.Device, *cudatest.Fake) {
	t.Helper()
	f := cudatest.Driver(t)
	d, err := cuda.OpenLibrary(f.Path)
	if err != nil {
		t.Fatal(err)
	}
	dv, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dv.Close() })
	return dv, f
}

// TestFakeDriverKernels compiles the real kernels (when NVRTC is here),
// loads them into the stand-in driver and checks what a launch passes.
func TestFakeDriverKernels(t *testing.T) {
	dv, f := fakeDevice(t)
	nv := testNVRTC(t)
	k, err := LoadKernels(dv, nv, VectorLoads)
	if err != nil {
		t.Fatal(err)
	}
	if k.Arch != 90 || k.Loads != VectorLoads || !strings.HasPrefix(f.Image(), "//") {
		t.Errorf("arch %d, loads %v, module image starts %q", k.Arch, k.Loads, f.Image())
	}
	s, _ := dv.NewStream()
	sc := optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 1)
	items := make([]Launch, MaxBatchTensors+2)
	for i := range items {
		items[i] = Launch{Param: 1, Grad: 2, ExpAvg: 3, ExpAvgSq: 4, Numel: int64(i+1) * 100000, Scalars: sc}
	}
	if err := k.AdamW(s, optimizer.BFloat16, items); err != nil {
		t.Fatal(err)
	}
	var dims [7]uint32
	var stream uintptr
	param := make([]byte, batchSize)
	f.Launch(&dims, &stream, &param[0], int32(len(param)))
	want, chunks, _ := PackBatch(items[MaxBatchTensors:]) // the second launch
	if !bytes.Equal(param, want) {
		t.Error("the kernel received a different batch than PackBatch built")
	}
	if dims != [7]uint32{gridFor(chunks, 132), 1, 1, threadsPerBlock, 1, 1, 0} || stream == 0 {
		t.Errorf("launch dims %v stream %#x", dims, stream)
	}
	f.Fail("cuLaunchKernel", int32(cuda.ErrorLaunchOutOfRes))
	if err := k.Accumulate(s, optimizer.Float32, []AddItem{{Dst: 1, Src: 2, Numel: 5}}); cuda.CodeOf(err) != cuda.ErrorLaunchOutOfRes ||
		!strings.Contains(err.Error(), "sonar_add_f32") {
		t.Errorf("launch failure: %v", err)
	}
	if err := k.AdamW(s, optimizer.DType(7), items[:1]); err == nil {
		t.Error("unknown dtype accepted")
	}
	if err := k.AdamW(s, optimizer.Float32, []Launch{{Numel: 1}}); err == nil {
		t.Error("null pointers accepted")
	}
	f.Fail("cuModuleLoadData", int32(cuda.ErrorUnsupportedPTX))
	if _, err := LoadKernels(dv, nv, ScalarLoads); err == nil || !strings.Contains(err.Error(), "newer than the driver, CUDA 13.0") {
		t.Errorf("PTX too new: %v", err)
	}
	if err := k.Close(); err != nil {
		t.Error(err)
	}
}

// fakeEngine is an engine on the stand-in driver with a placeholder module
// (kernels do not run there; launches are recorded).
func fakeEngine(t *testing.T) (*Engine, *cudatest.Fake) {
	t.Helper()
	dv, f := fakeDevice(t)
	k, err := LoadPTX(dv, []byte("// placeholder PTX\x00"), 90)
	if err != nil {
		t.Fatal(err)
	}
	e, err := NewEngineWith(dv, k)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e, f
}

func f32bytes(v ...float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func TestEngineLifecycle(t *testing.T) {
	e, f := fakeEngine(t)
	base := f.State(cudatest.LiveAllocs)
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	param, _ := e.Dev.Alloc(16)
	grad, _ := e.Dev.Alloc(16)
	defer e.Dev.Free(param)
	defer e.Dev.Free(grad)
	base += 2

	tests := []struct {
		name  string
		dt    optimizer.DType
		numel int64
		hyper optimizer.Hyper
		param cuda.DevicePtr
		err   string
	}{
		{"float16 refused", optimizer.DType(9), 4, h, param, "not supported on CUDA"},
		{"bad hyper", optimizer.Float32, 4, optimizer.Hyper{LR: -1, Beta1: 0.9, Beta2: 0.999}, param, "tensor \"x\""},
		{"no elements", optimizer.Float32, 0, h, param, "0 elements"},
		{"null param", optimizer.Float32, 4, h, 0, "elements at 0x0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := e.NewTensor("x", tc.dt, tc.numel, tc.hyper, tc.param); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("err = %v, want %q", err, tc.err)
			}
		})
	}
	if got := f.State(cudatest.LiveAllocs); got != base {
		t.Fatalf("refusals left %d allocations", got-base)
	}
	f.Fail("cuMemAlloc_v2", 2)
	if _, err := e.NewTensor("x", optimizer.Float32, 4, h, param); cuda.CodeOf(err) != cuda.ErrorOutOfMemory {
		t.Errorf("out of memory: %v", err)
	}
	ams := h
	ams.Amsgrad = true
	tt, err := e.NewTensor("w", optimizer.Float32, 4, ams, param)
	if err != nil {
		t.Fatal(err)
	}
	if f.State(cudatest.LiveAllocs) != base+3 || tt.StateBytes() != 48 {
		t.Errorf("amsgrad tensor: %d allocations, %d state bytes", f.State(cudatest.LiveAllocs)-base, tt.StateBytes())
	}

	// Accumulate twice, then apply: copy, add launch, AdamW launch, in
	// order after the client's event, and the step advances once.
	sc := optimizer.ScalarsFor(ams, 1)
	sc.Amsgrad = true
	f.ClearLog()
	if err := e.Step(nil, []Item{{T: tt, Grad: grad}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(nil, []Item{{T: tt, Grad: grad}}); err != nil {
		t.Fatal(err)
	}
	if tt.Pending() != 2 || tt.Step != 0 || tt.StateBytes() != 64 {
		t.Errorf("after 2 accumulations: pending %d step %d state %d", tt.Pending(), tt.Step, tt.StateBytes())
	}
	var evh cuda.IPCEventHandle
	ev, err := e.Dev.OpenIPCEvent(evh)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Destroy()
	if err := e.Step(ev, []Item{{T: tt, Grad: grad, Apply: true, Scalars: sc}}); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.TrimSpace(f.Log()), "copy record sync launch record sync wait launch launch record sync"; got != want {
		t.Errorf("stream operations %q, want %q", got, want)
	}
	if tt.Pending() != 0 || tt.Step != 1 || tt.StateBytes() != 48 {
		t.Errorf("after apply: pending %d step %d state %d (the accumulation buffer must go)", tt.Pending(), tt.Step, tt.StateBytes())
	}

	// Refusals change nothing.
	for _, tc := range []struct {
		name  string
		items []Item
		err   string
	}{
		{"nothing accumulated", []Item{{T: tt, Apply: true, Scalars: sc}}, "nothing accumulated"},
		{"amsgrad differs", []Item{{T: tt, Grad: grad, Apply: true, Scalars: optimizer.ScalarsFor(h, 2)}}, "amsgrad=false in step"},
		{"twice", []Item{{T: tt, Grad: grad}, {T: tt, Grad: grad}}, "twice"},
	} {
		if err := e.Step(nil, tc.items); err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s: err = %v", tc.name, err)
		}
	}
	if tt.Step != 1 || tt.Pending() != 0 {
		t.Errorf("a refused step changed the tensor: step %d pending %d", tt.Step, tt.Pending())
	}

	// Export and import through device memory the caller owns.
	st := make([]cuda.DevicePtr, 3)
	for i := range st {
		st[i], _ = e.Dev.Alloc(16)
		if err := e.Dev.CopyHtoD(st[i], f32bytes(float32(i+1), 2, 3, 4)); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Import(tt, 7, st); err != nil || tt.Step != 7 {
		t.Fatalf("import: %v, step %d", err, tt.Step)
	}
	if err := e.Import(tt, -1, st); err == nil {
		t.Error("negative step imported")
	}
	if err := e.Import(tt, 1, st[:2]); err == nil {
		t.Error("amsgrad import without max_exp_avg_sq accepted")
	}
	out := make([]cuda.DevicePtr, 3)
	for i := range out {
		out[i], _ = e.Dev.Alloc(16)
	}
	if err := e.Export(tt, out); err != nil {
		t.Fatal(err)
	}
	for i := range out {
		got := make([]byte, 16)
		_ = e.Dev.CopyDtoH(got, out[i])
		if !bytes.Equal(got, f32bytes(float32(i+1), 2, 3, 4)) {
			t.Errorf("state part %d round trip: % x", i, got)
		}
		_ = e.Dev.Free(out[i])
		_ = e.Dev.Free(st[i])
	}
	if err := e.Free(tt); err != nil {
		t.Fatal(err)
	}
	if got := f.State(cudatest.LiveAllocs); got != base {
		t.Errorf("%d allocations left after Free", got-base)
	}
}
