package cuda

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/sonar-moe/sonar/cuda/cudatest"
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

// fakeDriver opens the stand-in driver of package cudatest.
func fakeDriver(t *testing.T) (*Driver, *cudatest.Fake) {
	t.Helper()
	f := cudatest.Driver(t)
	d, err := OpenLibrary(f.Path)
	if err != nil {
		t.Fatal(err)
	}
	return d, f
}

func TestFakeDriverDeviceAndMemory(t *testing.T) {
	d, f := fakeDriver(t)
	state, fail := f.State, f.Fail
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
	d, f := fakeDriver(t)
	state, fail := f.State, f.Fail
	handles := func(mem, ev *IPCMemHandle) { f.Handles(&mem.Reserved, &ev.Reserved) }
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
	if eh, err := dv.IPCMemHandle(p); err != nil || eh.Reserved[20] != 0x24 {
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
