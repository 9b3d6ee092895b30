package cuda

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/sonar-moe/sonar/optimizer"
)

func TestOpenWithoutDriver(t *testing.T) {
	tests := []struct {
		name, lib, want string
	}{
		{"default soname", "libcuda-sonar-test-absent.so.1", "cuda: no CUDA driver (libcuda-sonar-test-absent.so.1 not found)"},
		{"path", "/nonexistent/dir/libcuda.so.1", "cuda: no CUDA driver (/nonexistent/dir/libcuda.so.1 not found)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, err := OpenLibrary(tc.lib)
			if d != nil || !errors.Is(err, ErrNoDriver) {
				t.Fatalf("OpenLibrary = %v, %v; want ErrNoDriver", d, err)
			}
			if err.Error() != tc.want {
				t.Errorf("message %q, want %q", err, tc.want)
			}
		})
	}
}

// TestOpenMessageOnThisMachine: Open's error on a machine without a driver
// is exactly the documented sentence.
func TestOpenMessageOnThisMachine(t *testing.T) {
	d, err := Open()
	if err == nil {
		t.Skipf("this machine has a CUDA driver (%s, CUDA %d)", d.Path(), d.Version())
	}
	if !errors.Is(err, ErrNoDriver) {
		t.Skipf("driver present but unusable here: %v", err)
	}
	if err.Error() != "cuda: no CUDA driver (libcuda.so.1 not found)" {
		t.Errorf("Open() error %q", err)
	}
}

func TestOpenNotALibrary(t *testing.T) {
	p := filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(p, []byte("not an ELF file"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := OpenLibrary(p)
	if !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "cannot load CUDA driver") {
		t.Fatalf("err = %v, want a load failure matching ErrNoDriver", err)
	}
}

func TestResultNames(t *testing.T) {
	tests := []struct {
		code   Result
		name   string
		sticky bool
	}{
		{Success, "CUDA_SUCCESS", false},
		{ErrorOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY", false},
		{ErrorNoDevice, "CUDA_ERROR_NO_DEVICE", false},
		{ErrorAlreadyMapped, "CUDA_ERROR_ALREADY_MAPPED", false},
		{ErrorUnsupportedPTX, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", false},
		{ErrorNotReady, "CUDA_ERROR_NOT_READY", false},
		{ErrorIllegalAddress, "CUDA_ERROR_ILLEGAL_ADDRESS", true},
		{ErrorLaunchFailed, "CUDA_ERROR_LAUNCH_FAILED", true},
		{Result(12345), "CUresult(12345)", false},
	}
	for _, tc := range tests {
		if got := tc.code.Name(); got != tc.name {
			t.Errorf("%d.Name() = %q, want %q", tc.code, got, tc.name)
		}
		if tc.code.Sticky() != tc.sticky {
			t.Errorf("%d.Sticky() = %v", tc.code, !tc.sticky)
		}
	}
	e := &Error{Op: "cuMemAlloc_v2", Code: ErrorOutOfMemory, Msg: "out of memory"}
	if e.Error() != "cuda: cuMemAlloc_v2: out of memory (CUDA_ERROR_OUT_OF_MEMORY)" {
		t.Errorf("Error() = %q", e)
	}
	wrapped := errors.Join(errors.New("context"), e)
	if !errors.Is(wrapped, &Error{Code: ErrorOutOfMemory}) || CodeOf(wrapped) != ErrorOutOfMemory {
		t.Error("errors.Is/CodeOf do not see the code through wrapping")
	}
	if errors.Is(wrapped, &Error{Code: ErrorInvalidValue}) || CodeOf(errors.New("x")) != Success {
		t.Error("wrong code matched")
	}
	if (&Error{Op: "cuInit", Code: 3}).Error() != "cuda: cuInit: CUDA_ERROR_NOT_INITIALIZED" {
		t.Error("message without driver text")
	}
	if NVRTCResult(6).Name() != "NVRTC_ERROR_COMPILATION" || NVRTCResult(77).Name() != "nvrtcResult(77)" {
		t.Error("nvrtc names")
	}
}

// fakeDriverC is a stand-in libcuda.so.1: every function the binding uses,
// with device memory in host memory, so that the purego calling convention
// of each signature (the 64-byte handles passed by value, the 11 arguments
// of cuLaunchKernel) is exercised for real without a GPU.
const fakeDriverC = `
#include <stdlib.h>
#include <string.h>
typedef unsigned long long u64;
typedef struct { char r[64]; } H;
static int fail_code; static char fail_op[64];
static int chk(const char* op) { if (fail_code && !strcmp(op, fail_op)) { int c = fail_code; fail_code = 0; return c; } return 0; }
void fake_fail(const char* op, int code) { strncpy(fail_op, op, 63); fail_code = code; }
static void* cur_ctx; static int retained, released;
static H last_mem_handle, last_event_handle; static unsigned last_ipc_flags; static int ipc_closed;
static unsigned launch_dims[7]; static void* launch_stream; static unsigned char launch_param[8192]; static int launch_nparams;
static char loaded_image[64];
int fake_state(int what) { switch (what) { case 0: return retained; case 1: return released; case 2: return (int)last_ipc_flags; case 3: return ipc_closed; } return -1; }
void fake_launch(unsigned* dims, void** stream, unsigned char* param, int n) { memcpy(dims, launch_dims, sizeof launch_dims); *stream = launch_stream; memcpy(param, launch_param, n); }
void fake_handles(H* mem, H* ev) { *mem = last_mem_handle; *ev = last_event_handle; }
const char* fake_image(void) { return loaded_image; }
int cuGetErrorString(int c, const char** s) { if (c == 2) { *s = "out of memory"; return 0; } if (c == 999) { *s = "unknown error"; return 0; } return 1; }
int cuGetErrorName(int c, const char** s) { *s = "X"; return 0; }
int cuInit(unsigned f) { return chk("cuInit"); }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
int cuDeviceGetCount(int* n) { *n = 1; return chk("cuDeviceGetCount"); }
int cuDeviceGet(int* d, int o) { if (o != 0) return 101; *d = 0; return 0; }
int cuDeviceGetName(char* n, int len, int d) { strncpy(n, "Fake H200", len); return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) { *v = a == 75 ? 9 : a == 76 ? 0 : a == 16 ? 132 : -1; return 0; }
int cuDeviceTotalMem_v2(size_t* b, int d) { *b = (size_t)141 << 30; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0xC0; retained++; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { released++; return 0; }
int cuCtxSetCurrent(void* c) { cur_ctx = c; return c == (void*)0xC0 ? 0 : 201; }
int cuMemAlloc_v2(u64* p, size_t n) { int e = chk("cuMemAlloc_v2"); if (e) return e; *p = (u64)malloc(n); return 0; }
int cuMemFree_v2(u64 p) { free((void*)p); return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t) { *f = 100; *t = 200; return 0; }
int cuMemGetAddressRange_v2(u64* base, size_t* size, u64 p) { *base = p; *size = 4096; return chk("cuMemGetAddressRange_v2"); }
int cuMemcpyHtoD_v2(u64 dst, const void* src, size_t n) { memcpy((void*)dst, src, n); return 0; }
int cuMemcpyDtoH_v2(void* dst, u64 src, size_t n) { memcpy(dst, (void*)src, n); return 0; }
int cuMemcpyDtoDAsync_v2(u64 dst, u64 src, size_t n, void* s) { memmove((void*)dst, (void*)src, n); return 0; }
int cuMemsetD8Async(u64 dst, unsigned char v, size_t n, void* s) { memset((void*)dst, v, n); return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = (void*)(0x5000 + (u64)f); return 0; }
int cuStreamDestroy_v2(void* s) { return 0; }
int cuStreamSynchronize(void* s) { return chk("cuStreamSynchronize"); }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { return e == (void*)0xE1 ? 0 : 400; }
int cuEventCreate(void** e, unsigned f) { *e = (void*)(0xE000 + (u64)f); return 0; }
int cuEventRecord(void* e, void* s) { return 0; }
int cuEventSynchronize(void* e) { return 0; }
static int queries; int cuEventQuery(void* e) { return queries++ == 0 ? 600 : 0; }
int cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 1.5f; return 0; }
int cuEventDestroy_v2(void* e) { return 0; }
int cuIpcGetEventHandle(H* h, void* e) { memset(h, 0x42, sizeof *h); return 0; }
int cuIpcOpenEventHandle(void** e, H h) { last_event_handle = h; *e = (void*)0xE1; return 0; }
int cuIpcGetMemHandle(H* h, u64 p) { memset(h, 0x24, sizeof *h); return 0; }
int cuIpcOpenMemHandle_v2(u64* p, H h, unsigned flags) { int e = chk("cuIpcOpenMemHandle_v2"); if (e) return e; last_mem_handle = h; last_ipc_flags = flags; *p = 0x7f0000000000ULL + (unsigned char)h.r[0] * 0x100000ULL; return 0; }
int cuIpcCloseMemHandle(u64 p) { ipc_closed++; return 0; }
int cuModuleLoadData(void** m, const void* img) { strncpy(loaded_image, (const char*)img, 63); *m = (void*)0x30; return chk("cuModuleLoadData"); }
int cuModuleUnload(void* m) { return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) { if (strncmp(name, "sonar_", 6)) return 500; *f = (void*)(0xF000 + strlen(name)); return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                   void* stream, void** params, void** extra) {
  unsigned d[7] = {gx, gy, gz, bx, by, bz, shmem}; memcpy(launch_dims, d, sizeof d); launch_stream = stream;
  if (extra) return 1;
  memcpy(launch_param, params[0], 3888); return chk("cuLaunchKernel");
}
`

var (
	fakeOnce sync.Once
	fakePath string
	fakeErr  error
)

// fakeDriver builds the stand-in driver with the host C compiler (the test
// is skipped where there is none) and opens it.
func fakeDriver(t *testing.T) (*Driver, uintptr) {
	t.Helper()
	fakeOnce.Do(func() {
		cc, err := exec.LookPath("cc")
		if err != nil {
			fakeErr = err
			return
		}
		dir, err := os.MkdirTemp("", "sonar-fakecuda")
		if err != nil {
			fakeErr = err
			return
		}
		src := filepath.Join(dir, "fake.c")
		if err := os.WriteFile(src, []byte(fakeDriverC), 0o644); err != nil {
			fakeErr = err
			return
		}
		fakePath = filepath.Join(dir, "libcuda.so.1")
		if out, err := exec.Command(cc, "-shared", "-fPIC", "-O1", "-o", fakePath, src).CombinedOutput(); err != nil {
			fakeErr = errors.New(string(out))
		}
	})
	if fakeErr != nil {
		t.Skipf("cannot build the fake driver: %v", fakeErr)
	}
	d, err := OpenLibrary(fakePath)
	if err != nil {
		t.Fatal(err)
	}
	h, err := purego.Dlopen(fakePath, purego.RTLD_NOW)
	if err != nil {
		t.Fatal(err)
	}
	return d, h
}

func fakeFunc[T any](t *testing.T, h uintptr, name string) T {
	t.Helper()
	var f T
	purego.RegisterLibFunc(&f, h, name)
	return f
}

func TestFakeDriverDeviceAndMemory(t *testing.T) {
	d, h := fakeDriver(t)
	state := fakeFunc[func(int32) int32](t, h, "fake_state")
	fail := fakeFunc[func(string, int32)](t, h, "fake_fail")
	if d.Version() != 13000 {
		t.Errorf("version %d", d.Version())
	}
	if n, err := d.DeviceCount(); n != 1 || err != nil {
		t.Errorf("DeviceCount = %d, %v", n, err)
	}
	if _, err := d.Device(3); CodeOf(err) != ErrorInvalidDevice {
		t.Errorf("Device(3) err = %v", err)
	}
	dv, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	if dv.Name != "Fake H200" || dv.Major != 9 || dv.Minor != 0 || dv.SMs != 132 || dv.TotalMem != 141<<30 {
		t.Errorf("device %+v", dv)
	}
	p, err := dv.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	src := []byte(strings.Repeat("0123456789abcdef", 4))
	if err := dv.CopyHtoD(p, src); err != nil {
		t.Fatal(err)
	}
	s, err := dv.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	q, _ := dv.Alloc(64)
	if err := s.CopyDtoD(q, p, 64); err != nil {
		t.Fatal(err)
	}
	if err := s.Zero(q, 8); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 64)
	if err := dv.CopyDtoH(dst, q); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[8:], src[8:]) || !bytes.Equal(dst[:8], make([]byte, 8)) {
		t.Errorf("round trip: %q", dst)
	}
	if f, tot, err := dv.MemInfo(); f != 100 || tot != 200 || err != nil {
		t.Errorf("MemInfo %d %d %v", f, tot, err)
	}
	fail("cuMemAlloc_v2", 2)
	if _, err := dv.Alloc(1); CodeOf(err) != ErrorOutOfMemory || !strings.Contains(err.Error(), "out of memory (CUDA_ERROR_OUT_OF_MEMORY)") {
		t.Errorf("alloc failure: %v", err)
	}
	if _, err := dv.Alloc(0); err == nil {
		t.Error("Alloc(0) accepted")
	}
	for _, f := range []DevicePtr{p, q} {
		if err := dv.Free(f); err != nil {
			t.Error(err)
		}
	}
	if err := s.Sync(); err != nil {
		t.Error(err)
	}
	if err := s.Destroy(); err != nil {
		t.Error(err)
	}
	if err := dv.Close(); err != nil || state(0) < 1 || state(1) < 1 {
		t.Errorf("Close: %v, retained %d released %d", err, state(0), state(1))
	}
	if err := dv.Do(func() error { return nil }); err == nil {
		t.Error("a closed device still runs calls")
	}
}

func TestFakeDriverIPCAndEvents(t *testing.T) {
	d, h := fakeDriver(t)
	state := fakeFunc[func(int32) int32](t, h, "fake_state")
	fail := fakeFunc[func(string, int32)](t, h, "fake_fail")
	handles := fakeFunc[func(mem, ev *IPCMemHandle)](t, h, "fake_handles")
	dv, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dv.Close()
	var mh IPCMemHandle
	for i := range mh.Reserved {
		mh.Reserved[i] = byte(3 + i)
	}
	p, size, err := dv.OpenIPCMem(mh)
	if err != nil {
		t.Fatal(err)
	}
	var gotMem, gotEv IPCMemHandle
	handles(&gotMem, &gotEv)
	if gotMem != mh {
		t.Errorf("the driver received handle %x, want %x: the 64-byte struct was not passed by value", gotMem.Reserved, mh.Reserved)
	}
	if state(2) != ipcMemLazyEnablePeerAccess {
		t.Errorf("flags %d, want CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS", state(2))
	}
	if p != 0x7f0000000000+3*0x100000 || size != 4096 {
		t.Errorf("OpenIPCMem = %#x, %d", p, size)
	}
	closed := state(3)
	fail("cuMemGetAddressRange_v2", 1)
	if _, _, err := dv.OpenIPCMem(mh); err == nil || state(3) != closed+1 {
		t.Errorf("a failed size query must close the handle again: %v, closes %d", err, state(3)-closed)
	}
	fail("cuIpcOpenMemHandle_v2", int32(ErrorAlreadyMapped))
	if _, _, err := dv.OpenIPCMem(mh); CodeOf(err) != ErrorAlreadyMapped {
		t.Errorf("err = %v", err)
	}
	if err := dv.CloseIPCMem(p); err != nil {
		t.Error(err)
	}
	if eh, err := dv.IPCMemHandle(p); err != nil || eh.Reserved[0] != 0x24 {
		t.Errorf("IPCMemHandle %v %v", eh, err)
	}

	var evh IPCEventHandle
	for i := range evh.Reserved {
		evh.Reserved[i] = byte(200 - i)
	}
	ev, err := dv.OpenIPCEvent(evh)
	if err != nil {
		t.Fatal(err)
	}
	handles(&gotMem, &gotEv)
	if gotEv.Reserved != evh.Reserved {
		t.Errorf("event handle not passed by value: %x", gotEv.Reserved)
	}
	s, _ := dv.NewStream()
	if err := s.WaitEvent(ev); err != nil {
		t.Errorf("WaitEvent on the opened IPC event: %v", err)
	}
	own, err := dv.NewEvent(EventInterprocess)
	if err != nil {
		t.Fatal(err)
	}
	if own.h != 0xE000+eventInterprocess+eventDisableTiming {
		t.Errorf("interprocess event flags %#x", own.h-0xE000)
	}
	if x, err := own.IPCHandle(); err != nil || x.Reserved[5] != 0x42 {
		t.Errorf("IPCHandle %v %v", x, err)
	}
	if err := s.WaitEvent(own); CodeOf(err) != ErrorInvalidHandle {
		t.Errorf("fake wait on another event: %v", err)
	}
	if err := own.Record(s); err != nil {
		t.Error(err)
	}
	if done, err := own.Done(); done || err != nil {
		t.Errorf("first query: %v %v (fake says not ready)", done, err)
	}
	if done, err := own.Done(); !done || err != nil {
		t.Errorf("second query: %v %v", done, err)
	}
	tm, _ := dv.NewEvent(EventTiming)
	if ms, err := tm.Elapsed(own); ms != 1.5 || err != nil {
		t.Errorf("Elapsed %v %v", ms, err)
	}
	if _, err := dv.NewEvent(EventKind(9)); err == nil {
		t.Error("bad event kind accepted")
	}
	for _, e := range []*Event{ev, own, tm} {
		if err := e.Sync(); err != nil {
			t.Error(err)
		}
		if err := e.Destroy(); err != nil {
			t.Error(err)
		}
	}
}

// TestFakeDriverKernels compiles the real kernels (when NVRTC is here),
// "loads" them into the fake driver and checks what a launch passes.
func TestFakeDriverKernels(t *testing.T) {
	d, h := fakeDriver(t)
	nv := testNVRTC(t)
	fail := fakeFunc[func(string, int32)](t, h, "fake_fail")
	image := fakeFunc[func() string](t, h, "fake_image")
	launch := fakeFunc[func(dims *[7]uint32, stream *uintptr, param *byte, n int32)](t, h, "fake_launch")
	dv, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dv.Close()
	k, err := LoadKernels(dv, nv)
	if err != nil {
		t.Fatal(err)
	}
	if k.Arch != 90 || !strings.HasPrefix(image(), "//") {
		t.Errorf("arch %d, module image starts %q", k.Arch, image())
	}
	s, _ := dv.NewStream()
	sc := optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 1)
	items := make([]Tensor, MaxBatchTensors+2)
	for i := range items {
		items[i] = Tensor{Param: 1, Grad: 2, ExpAvg: 3, ExpAvgSq: 4, Numel: int64(i+1) * 100000, Scalars: sc}
	}
	if err := k.AdamW(s, optimizer.BFloat16, items); err != nil {
		t.Fatal(err)
	}
	var dims [7]uint32
	var stream uintptr
	param := make([]byte, batchSize)
	launch(&dims, &stream, &param[0], int32(len(param)))
	want, chunks, _ := PackBatch(items[MaxBatchTensors:]) // the second launch
	if !bytes.Equal(param, want) {
		t.Error("the kernel received a different batch than PackBatch built")
	}
	if dims != [7]uint32{gridFor(chunks, 132), 1, 1, threadsPerBlock, 1, 1, 0} || stream != s.h {
		t.Errorf("launch dims %v stream %#x", dims, stream)
	}
	fail("cuLaunchKernel", int32(ErrorLaunchOutOfRes))
	if err := k.Accumulate(s, optimizer.Float32, []AddItem{{Dst: 1, Src: 2, Numel: 5}}); CodeOf(err) != ErrorLaunchOutOfRes ||
		!strings.Contains(err.Error(), "sonar_add_f32") {
		t.Errorf("launch failure: %v", err)
	}
	if err := k.AdamW(s, optimizer.DType(7), items[:1]); err == nil {
		t.Error("unknown dtype accepted")
	}
	if err := k.AdamW(s, optimizer.Float32, []Tensor{{Numel: 1}}); err == nil {
		t.Error("null pointers accepted")
	}
	fail("cuModuleLoadData", int32(ErrorUnsupportedPTX))
	if _, err := LoadKernels(dv, nv); err == nil || !strings.Contains(err.Error(), "newer than the driver, CUDA 13.0") {
		t.Errorf("PTX too new: %v", err)
	}
	if err := k.Close(); err != nil {
		t.Error(err)
	}
}

func TestArgsPointers(t *testing.T) {
	batch := []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	a := NewArgs().Ptr(0xdeadbeef00).U32(7).F32(1.5).I64(-2).Bytes(batch).Bytes(nil)
	if a.Len() != 6 {
		t.Fatalf("Len %d", a.Len())
	}
	ptrs := a.pointers()
	read := func(i, n int) []byte { return unsafe.Slice((*byte)(ptrs[i]), n) }
	tests := []struct {
		i    int
		want []byte
	}{
		{0, []byte{0x00, 0xef, 0xbe, 0xad, 0xde, 0, 0, 0}},
		{1, []byte{7, 0, 0, 0}},
		{2, []byte{0, 0, 0xc0, 0x3f}},
		{3, []byte{0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
		{4, batch},
		{5, []byte{0}},
	}
	for _, tc := range tests {
		if got := read(tc.i, len(tc.want)); !bytes.Equal(got, tc.want) {
			t.Errorf("argument %d: % x, want % x", tc.i, got, tc.want)
		}
		if uintptr(ptrs[tc.i])%8 != 0 {
			t.Errorf("argument %d not 8-byte aligned", tc.i)
		}
	}
	batch[0] = 99
	if read(4, 1)[0] != 1 {
		t.Error("Args must copy by-value parameters")
	}
	if (*Args)(nil).pointers() != nil {
		t.Error("nil Args")
	}
}
