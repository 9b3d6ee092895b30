package cuda

import (
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// DriverLibrary is the CUDA driver's shared library (the versioned soname
// the driver installs; the unversioned name is a development symlink).
const DriverLibrary = "libcuda.so.1"

// DevicePtr is a device address (CUdeviceptr).
type DevicePtr uint64

// IPCMemHandle is a CUipcMemHandle: it names a device allocation of another
// process (the whole cudaMalloc block, not a tensor inside it).
type IPCMemHandle struct{ Reserved [64]byte }

// IPCEventHandle is a CUipcEventHandle: an event of another process created
// with CU_EVENT_INTERPROCESS.
type IPCEventHandle struct{ Reserved [64]byte }

func (h IPCMemHandle) String() string   { return hex.EncodeToString(h.Reserved[:8]) + "…" }
func (h IPCEventHandle) String() string { return hex.EncodeToString(h.Reserved[:8]) + "…" }

// Driver API constants (cuda.h).
const (
	streamNonBlocking          = 0x1 // CU_STREAM_NON_BLOCKING
	eventBlockingSync          = 0x1 // CU_EVENT_BLOCKING_SYNC
	eventDisableTiming         = 0x2 // CU_EVENT_DISABLE_TIMING
	eventInterprocess          = 0x4 // CU_EVENT_INTERPROCESS
	ipcMemLazyEnablePeerAccess = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	attrMultiprocessorCount    = 16  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
	attrComputeCapabilityMajor = 75  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
	attrComputeCapabilityMinor = 76  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
)

// driverAPI holds the driver functions, bound at run time. Pointer
// arguments that C writes are Go pointers to plain values; memory the
// device reads from or writes to the host is passed as unsafe.Pointer.
type driverAPI struct {
	cuInit                       func(flags uint32) int32
	cuDriverGetVersion           func(v *int32) int32
	cuGetErrorString             func(code int32, s **byte) int32
	cuGetErrorName               func(code int32, s **byte) int32
	cuDeviceGetCount             func(n *int32) int32
	cuDeviceGet                  func(dev *int32, ordinal int32) int32
	cuDeviceGetName              func(name *byte, n int32, dev int32) int32
	cuDeviceGetAttribute         func(v *int32, attr int32, dev int32) int32
	cuDeviceTotalMem             func(bytes *uint64, dev int32) int32
	cuDevicePrimaryCtxRetain     func(ctx *uintptr, dev int32) int32
	cuDevicePrimaryCtxRelease    func(dev int32) int32
	cuCtxSetCurrent              func(ctx uintptr) int32
	cuMemAlloc                   func(p *DevicePtr, n uint64) int32
	cuMemFree                    func(p DevicePtr) int32
	cuMemGetInfo                 func(free, total *uint64) int32
	cuMemGetAddressRange         func(base *DevicePtr, size *uint64, p DevicePtr) int32
	cuMemcpyHtoD                 func(dst DevicePtr, src unsafe.Pointer, n uint64) int32
	cuMemcpyDtoH                 func(dst unsafe.Pointer, src DevicePtr, n uint64) int32
	cuMemcpyDtoDAsync            func(dst, src DevicePtr, n uint64, stream uintptr) int32
	cuMemsetD8Async              func(dst DevicePtr, v uint8, n uint64, stream uintptr) int32
	cuStreamCreate               func(s *uintptr, flags uint32) int32
	cuStreamDestroy              func(s uintptr) int32
	cuStreamSynchronize          func(s uintptr) int32
	cuStreamWaitEvent            func(s, e uintptr, flags uint32) int32
	cuEventCreate                func(e *uintptr, flags uint32) int32
	cuEventRecord                func(e, s uintptr) int32
	cuEventSynchronize           func(e uintptr) int32
	cuEventQuery                 func(e uintptr) int32
	cuEventElapsedTime           func(ms *float32, start, end uintptr) int32
	cuEventDestroy               func(e uintptr) int32
	cuIpcGetEventHandle          func(h *IPCEventHandle, e uintptr) int32
	cuIpcOpenEventHandle         func(e *uintptr, h IPCEventHandle) int32
	cuIpcGetMemHandle            func(h *IPCMemHandle, p DevicePtr) int32
	cuIpcOpenMemHandle           func(p *DevicePtr, h IPCMemHandle, flags uint32) int32
	cuIpcCloseMemHandle          func(p DevicePtr) int32
	cuModuleLoadData             func(m *uintptr, image unsafe.Pointer) int32
	cuModuleUnload               func(m uintptr) int32
	cuModuleGetFunction          func(f *uintptr, m uintptr, name string) int32
	cuLaunchKernel               func(f uintptr, gx, gy, gz, bx, by, bz, shmem uint32, stream uintptr, params, extra unsafe.Pointer) int32
	hasErrorString, hasErrorName bool
}

// bind binds every function; the versioned names (_v2) are the ones the
// driver exports for the 64-bit API (cuda.h #defines the plain names to them).
func (a *driverAPI) bind(b *binder) {
	a.hasErrorString = b.optional(&a.cuGetErrorString, "cuGetErrorString")
	a.hasErrorName = b.optional(&a.cuGetErrorName, "cuGetErrorName")
	b.bind(&a.cuInit, "cuInit")
	b.bind(&a.cuDriverGetVersion, "cuDriverGetVersion")
	b.bind(&a.cuDeviceGetCount, "cuDeviceGetCount")
	b.bind(&a.cuDeviceGet, "cuDeviceGet")
	b.bind(&a.cuDeviceGetName, "cuDeviceGetName")
	b.bind(&a.cuDeviceGetAttribute, "cuDeviceGetAttribute")
	b.bind(&a.cuDeviceTotalMem, "cuDeviceTotalMem_v2")
	b.bind(&a.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
	b.bind(&a.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")
	b.bind(&a.cuCtxSetCurrent, "cuCtxSetCurrent")
	b.bind(&a.cuMemAlloc, "cuMemAlloc_v2")
	b.bind(&a.cuMemFree, "cuMemFree_v2")
	b.bind(&a.cuMemGetInfo, "cuMemGetInfo_v2")
	b.bind(&a.cuMemGetAddressRange, "cuMemGetAddressRange_v2")
	b.bind(&a.cuMemcpyHtoD, "cuMemcpyHtoD_v2")
	b.bind(&a.cuMemcpyDtoH, "cuMemcpyDtoH_v2")
	b.bind(&a.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")
	b.bind(&a.cuMemsetD8Async, "cuMemsetD8Async")
	b.bind(&a.cuStreamCreate, "cuStreamCreate")
	b.bind(&a.cuStreamDestroy, "cuStreamDestroy_v2")
	b.bind(&a.cuStreamSynchronize, "cuStreamSynchronize")
	b.bind(&a.cuStreamWaitEvent, "cuStreamWaitEvent")
	b.bind(&a.cuEventCreate, "cuEventCreate")
	b.bind(&a.cuEventRecord, "cuEventRecord")
	b.bind(&a.cuEventSynchronize, "cuEventSynchronize")
	b.bind(&a.cuEventQuery, "cuEventQuery")
	b.bind(&a.cuEventElapsedTime, "cuEventElapsedTime")
	b.bind(&a.cuEventDestroy, "cuEventDestroy_v2")
	b.bind(&a.cuIpcGetEventHandle, "cuIpcGetEventHandle")
	b.bind(&a.cuIpcOpenEventHandle, "cuIpcOpenEventHandle")
	b.bind(&a.cuIpcGetMemHandle, "cuIpcGetMemHandle")
	b.bind(&a.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2")
	b.bind(&a.cuIpcCloseMemHandle, "cuIpcCloseMemHandle")
	b.bind(&a.cuModuleLoadData, "cuModuleLoadData")
	b.bind(&a.cuModuleUnload, "cuModuleUnload")
	b.bind(&a.cuModuleGetFunction, "cuModuleGetFunction")
	b.bind(&a.cuLaunchKernel, "cuLaunchKernel")
}

// Driver is the loaded CUDA driver API.
type Driver struct {
	api     driverAPI
	path    string
	version int
}

var (
	defaultOnce sync.Once
	defaultDrv  *Driver
	defaultErr  error
)

// Open loads the CUDA driver (libcuda.so.1) once per process and
// initializes it. Without a driver it returns an error that reads
// "cuda: no CUDA driver (libcuda.so.1 not found)" and matches ErrNoDriver.
func Open() (*Driver, error) {
	defaultOnce.Do(func() { defaultDrv, defaultErr = OpenLibrary(DriverLibrary) })
	return defaultDrv, defaultErr
}

// OpenLibrary loads the driver API from the named library (a soname looked up
// by the dynamic loader, or a path) and calls cuInit. Prefer Open; this is
// for tests and unusual installations.
func OpenLibrary(name string) (*Driver, error) {
	h, path, err := openLibrary(ErrNoDriver, "CUDA driver", []string{name})
	if err != nil {
		return nil, err
	}
	d := &Driver{path: path}
	b := &binder{lib: h, libName: path}
	d.api.bind(b)
	if b.err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDriver, b.err)
	}
	if err := d.check("cuInit", d.api.cuInit(0)); err != nil {
		if CodeOf(err) == ErrorStubLibrary || CodeOf(err) == ErrorNoDevice {
			return nil, fmt.Errorf("%w: %w", ErrNoDriver, err)
		}
		return nil, err
	}
	var v int32
	if err := d.check("cuDriverGetVersion", d.api.cuDriverGetVersion(&v)); err != nil {
		return nil, err
	}
	d.version = int(v)
	return d, nil
}

// Path is the library the driver was loaded from.
func (d *Driver) Path() string { return d.path }

// Version is the CUDA version the driver supports, as 1000*major + 10*minor
// (13000 for CUDA 13.0).
func (d *Driver) Version() int { return d.version }

// check turns a CUresult into nil or an *Error with the driver's message.
func (d *Driver) check(op string, code int32) error {
	if code == 0 {
		return nil
	}
	return &Error{Op: op, Code: Result(code), Msg: d.errorString(Result(code))}
}

// errorString asks the driver to describe code ("" when it cannot).
func (d *Driver) errorString(code Result) string {
	if d == nil || !d.api.hasErrorString {
		return ""
	}
	var s *byte
	if d.api.cuGetErrorString(int32(code), &s) != 0 {
		return ""
	}
	return goString(s)
}

// DeviceCount is the number of CUDA devices visible to this process.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	if err := d.check("cuDeviceGetCount", d.api.cuDeviceGetCount(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// ErrNoDevice is returned (wrapped) by OpenDevice when the driver loads but
// the device asked for is not there.
var ErrNoDevice = errors.New("cuda: no such device")

// OpenDevice loads the driver (Open) and opens device ordinal, after
// checking that it is one of the visible devices.
func OpenDevice(ordinal int) (*Device, error) {
	d, err := Open()
	if err != nil {
		return nil, err
	}
	n, err := d.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDevice, err)
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("%w: device %d requested, %d visible", ErrNoDevice, ordinal, n)
	}
	return d.Device(ordinal)
}

// Device retains the primary context of device ordinal and describes it.
// Close releases the context.
func (d *Driver) Device(ordinal int) (*Device, error) {
	var dev int32
	if err := d.check("cuDeviceGet", d.api.cuDeviceGet(&dev, int32(ordinal))); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	dv := &Device{drv: d, dev: dev, Ordinal: ordinal}
	name := make([]byte, 256)
	if err := d.check("cuDeviceGetName", d.api.cuDeviceGetName(&name[0], int32(len(name)), dev)); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	dv.Name = goString(&name[0])
	for _, a := range []struct {
		attr int32
		dst  *int
	}{{attrComputeCapabilityMajor, &dv.Major}, {attrComputeCapabilityMinor, &dv.Minor}, {attrMultiprocessorCount, &dv.SMs}} {
		var v int32
		if err := d.check("cuDeviceGetAttribute", d.api.cuDeviceGetAttribute(&v, a.attr, dev)); err != nil {
			return nil, fmt.Errorf("device %d: %w", ordinal, err)
		}
		*a.dst = int(v)
	}
	var total uint64
	if err := d.check("cuDeviceTotalMem_v2", d.api.cuDeviceTotalMem(&total, dev)); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	dv.TotalMem = int64(total)
	if err := d.check("cuDevicePrimaryCtxRetain", d.api.cuDevicePrimaryCtxRetain(&dv.ctx, dev)); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	return dv, nil
}

// Device is one GPU with its primary context retained (the context the CUDA
// runtime, and so PyTorch, uses too).
type Device struct {
	drv     *Driver
	dev     int32
	ctx     uintptr
	Ordinal int
	Name    string
	Major   int // compute capability
	Minor   int
	SMs     int // multiprocessors
	// TotalMem is the device memory in bytes.
	TotalMem int64
	closed   bool
}

// Driver is the driver the device was opened with.
func (dv *Device) Driver() *Driver { return dv.drv }

// Do runs f on a locked OS thread with the device's context current. Every
// method of Device, Stream, Event and Module goes through it.
func (dv *Device) Do(f func() error) error {
	if dv.closed {
		return errors.New("cuda: device is closed")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := dv.drv.check("cuCtxSetCurrent", dv.drv.api.cuCtxSetCurrent(dv.ctx)); err != nil {
		return err
	}
	return f()
}

// call runs one driver call with the context current.
func (dv *Device) call(op string, f func() int32) error {
	return dv.Do(func() error { return dv.drv.check(op, f()) })
}

// Close releases the primary context. Memory, streams and events of the
// device must have been freed first.
func (dv *Device) Close() error {
	if dv.closed {
		return nil
	}
	dv.closed = true
	return dv.drv.check("cuDevicePrimaryCtxRelease_v2", dv.drv.api.cuDevicePrimaryCtxRelease(dv.dev))
}

// MemInfo reports free and total device memory in bytes.
func (dv *Device) MemInfo() (free, total int64, err error) {
	var f, t uint64
	err = dv.call("cuMemGetInfo_v2", func() int32 { return dv.drv.api.cuMemGetInfo(&f, &t) })
	return int64(f), int64(t), err
}

// Alloc allocates n bytes of device memory (cuMemAlloc_v2: 256-byte aligned).
func (dv *Device) Alloc(n int64) (DevicePtr, error) {
	if n <= 0 {
		return 0, fmt.Errorf("cuda: alloc of %d bytes", n)
	}
	var p DevicePtr
	if err := dv.call("cuMemAlloc_v2", func() int32 { return dv.drv.api.cuMemAlloc(&p, uint64(n)) }); err != nil {
		return 0, fmt.Errorf("allocating %d bytes: %w", n, err)
	}
	return p, nil
}

// Free frees memory from Alloc.
func (dv *Device) Free(p DevicePtr) error {
	if p == 0 {
		return nil
	}
	return dv.call("cuMemFree_v2", func() int32 { return dv.drv.api.cuMemFree(p) })
}

// CopyHtoD copies src to device memory at dst (synchronous).
func (dv *Device) CopyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	err := dv.call("cuMemcpyHtoD_v2", func() int32 {
		return dv.drv.api.cuMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uint64(len(src)))
	})
	runtime.KeepAlive(src)
	return err
}

// CopyDtoH copies len(dst) bytes of device memory at src to dst (synchronous).
func (dv *Device) CopyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	err := dv.call("cuMemcpyDtoH_v2", func() int32 {
		return dv.drv.api.cuMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uint64(len(dst)))
	})
	runtime.KeepAlive(dst)
	return err
}

// AddressRange returns the allocation that contains p: its base and size.
func (dv *Device) AddressRange(p DevicePtr) (DevicePtr, int64, error) {
	var base DevicePtr
	var size uint64
	err := dv.call("cuMemGetAddressRange_v2", func() int32 { return dv.drv.api.cuMemGetAddressRange(&base, &size, p) })
	return base, int64(size), err
}

// OpenIPCMem maps another process's allocation (cuIpcOpenMemHandle_v2 with
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) and returns its base and size. A handle
// can be open only once per context at a time: use IPCCache.
func (dv *Device) OpenIPCMem(h IPCMemHandle) (DevicePtr, int64, error) {
	var p DevicePtr
	var size uint64
	err := dv.Do(func() error {
		if err := dv.drv.check("cuIpcOpenMemHandle_v2", dv.drv.api.cuIpcOpenMemHandle(&p, h, ipcMemLazyEnablePeerAccess)); err != nil {
			return err
		}
		var base DevicePtr
		if err := dv.drv.check("cuMemGetAddressRange_v2", dv.drv.api.cuMemGetAddressRange(&base, &size, p)); err != nil {
			_ = dv.drv.api.cuIpcCloseMemHandle(p)
			return err
		}
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("opening IPC memory handle %v: %w", h, err)
	}
	return p, int64(size), nil
}

// CloseIPCMem unmaps memory from OpenIPCMem.
func (dv *Device) CloseIPCMem(p DevicePtr) error {
	return dv.call("cuIpcCloseMemHandle", func() int32 { return dv.drv.api.cuIpcCloseMemHandle(p) })
}

// IPCMemHandle exports an allocation of this process (p must be its base).
func (dv *Device) IPCMemHandle(p DevicePtr) (IPCMemHandle, error) {
	var h IPCMemHandle
	err := dv.call("cuIpcGetMemHandle", func() int32 { return dv.drv.api.cuIpcGetMemHandle(&h, p) })
	return h, err
}

// Stream is a CUDA stream created non-blocking (it does not synchronize with
// the legacy default stream).
type Stream struct {
	dv *Device
	h  uintptr
}

// NewStream creates a stream.
func (dv *Device) NewStream() (*Stream, error) {
	s := &Stream{dv: dv}
	if err := dv.call("cuStreamCreate", func() int32 { return dv.drv.api.cuStreamCreate(&s.h, streamNonBlocking) }); err != nil {
		return nil, err
	}
	return s, nil
}

// Sync waits until everything queued on the stream has finished.
func (s *Stream) Sync() error {
	return s.dv.call("cuStreamSynchronize", func() int32 { return s.dv.drv.api.cuStreamSynchronize(s.h) })
}

// WaitEvent makes later work on s wait for the most recent record of e
// (which may belong to another process: OpenIPCEvent). The host does not wait.
func (s *Stream) WaitEvent(e *Event) error {
	return s.dv.call("cuStreamWaitEvent", func() int32 { return s.dv.drv.api.cuStreamWaitEvent(s.h, e.h, 0) })
}

// CopyDtoD queues a device-to-device copy of n bytes.
func (s *Stream) CopyDtoD(dst, src DevicePtr, n int64) error {
	return s.dv.call("cuMemcpyDtoDAsync_v2", func() int32 { return s.dv.drv.api.cuMemcpyDtoDAsync(dst, src, uint64(n), s.h) })
}

// Zero queues setting n bytes at dst to zero.
func (s *Stream) Zero(dst DevicePtr, n int64) error {
	return s.dv.call("cuMemsetD8Async", func() int32 { return s.dv.drv.api.cuMemsetD8Async(dst, 0, uint64(n), s.h) })
}

// Destroy destroys the stream (work queued on it still completes).
func (s *Stream) Destroy() error {
	if s.h == 0 {
		return nil
	}
	h := s.h
	s.h = 0
	return s.dv.call("cuStreamDestroy_v2", func() int32 { return s.dv.drv.api.cuStreamDestroy(h) })
}

// EventKind selects how an event is created.
type EventKind int

const (
	// EventSync is for ordering and host waits: no timing, blocking sync
	// (the waiting host thread sleeps instead of spinning).
	EventSync EventKind = iota
	// EventTiming records timestamps (Elapsed).
	EventTiming
	// EventInterprocess can be exported to another process (IPCHandle).
	EventInterprocess
)

// Event is a CUDA event.
type Event struct {
	dv *Device
	h  uintptr
}

// NewEvent creates an event of the given kind.
func (dv *Device) NewEvent(kind EventKind) (*Event, error) {
	var flags uint32
	switch kind {
	case EventSync:
		flags = eventDisableTiming | eventBlockingSync
	case EventTiming:
		flags = 0
	case EventInterprocess:
		flags = eventDisableTiming | eventInterprocess
	default:
		return nil, fmt.Errorf("cuda: unknown event kind %d", kind)
	}
	e := &Event{dv: dv}
	if err := dv.call("cuEventCreate", func() int32 { return dv.drv.api.cuEventCreate(&e.h, flags) }); err != nil {
		return nil, err
	}
	return e, nil
}

// OpenIPCEvent opens an interprocess event of another process.
func (dv *Device) OpenIPCEvent(h IPCEventHandle) (*Event, error) {
	e := &Event{dv: dv}
	if err := dv.call("cuIpcOpenEventHandle", func() int32 { return dv.drv.api.cuIpcOpenEventHandle(&e.h, h) }); err != nil {
		return nil, fmt.Errorf("opening IPC event handle %v: %w", h, err)
	}
	return e, nil
}

// Record captures the work queued on s so far.
func (e *Event) Record(s *Stream) error {
	return e.dv.call("cuEventRecord", func() int32 { return e.dv.drv.api.cuEventRecord(e.h, s.h) })
}

// Sync blocks the calling goroutine until the recorded work has finished.
func (e *Event) Sync() error {
	return e.dv.call("cuEventSynchronize", func() int32 { return e.dv.drv.api.cuEventSynchronize(e.h) })
}

// Done reports whether the recorded work has finished, without waiting.
func (e *Event) Done() (bool, error) {
	var code int32
	err := e.dv.Do(func() error { code = e.dv.drv.api.cuEventQuery(e.h); return nil })
	switch {
	case err != nil:
		return false, err
	case code == 0:
		return true, nil
	case Result(code) == ErrorNotReady:
		return false, nil
	}
	return false, e.dv.drv.check("cuEventQuery", code)
}

// Elapsed is the time in milliseconds between two recorded timing events.
func (e *Event) Elapsed(start *Event) (float32, error) {
	var ms float32
	err := e.dv.call("cuEventElapsedTime", func() int32 { return e.dv.drv.api.cuEventElapsedTime(&ms, start.h, e.h) })
	return ms, err
}

// IPCHandle exports an EventInterprocess event.
func (e *Event) IPCHandle() (IPCEventHandle, error) {
	var h IPCEventHandle
	err := e.dv.call("cuIpcGetEventHandle", func() int32 { return e.dv.drv.api.cuIpcGetEventHandle(&h, e.h) })
	return h, err
}

// Destroy destroys the event.
func (e *Event) Destroy() error {
	if e.h == 0 {
		return nil
	}
	h := e.h
	e.h = 0
	return e.dv.call("cuEventDestroy_v2", func() int32 { return e.dv.drv.api.cuEventDestroy(h) })
}

// Module is loaded device code.
type Module struct {
	dv *Device
	h  uintptr
}

// Function is a kernel of a module.
type Function struct {
	m    *Module
	h    uintptr
	Name string
}

// LoadModule loads PTX (or a cubin) with cuModuleLoadData; the driver
// compiles PTX for the device.
func (dv *Device) LoadModule(image []byte) (*Module, error) {
	if len(image) == 0 {
		return nil, errors.New("cuda: empty module image")
	}
	img := image
	if img[len(img)-1] != 0 { // PTX must be NUL-terminated
		img = append(append(make([]byte, 0, len(image)+1), image...), 0)
	}
	m := &Module{dv: dv}
	err := dv.call("cuModuleLoadData", func() int32 { return dv.drv.api.cuModuleLoadData(&m.h, unsafe.Pointer(&img[0])) })
	runtime.KeepAlive(img)
	if err != nil {
		if CodeOf(err) == ErrorUnsupportedPTX {
			return nil, fmt.Errorf("loading module: %w (the NVRTC that compiled it is newer than the driver, CUDA %d.%d: use an NVRTC of at most the driver's version)",
				err, dv.drv.version/1000, dv.drv.version%1000/10)
		}
		return nil, fmt.Errorf("loading module: %w", err)
	}
	return m, nil
}

// Function looks up a kernel by its (extern "C") name.
func (m *Module) Function(name string) (*Function, error) {
	f := &Function{m: m, Name: name}
	if err := m.dv.call("cuModuleGetFunction", func() int32 { return m.dv.drv.api.cuModuleGetFunction(&f.h, m.h, name) }); err != nil {
		return nil, fmt.Errorf("kernel %s: %w", name, err)
	}
	return f, nil
}

// Unload unloads the module.
func (m *Module) Unload() error {
	if m.h == 0 {
		return nil
	}
	h := m.h
	m.h = 0
	return m.dv.call("cuModuleUnload", func() int32 { return m.dv.drv.api.cuModuleUnload(h) })
}

// Dim3 is a grid or block size.
type Dim3 struct{ X, Y, Z uint32 }

// Launch queues f on s with the given arguments (see Args).
func (f *Function) Launch(s *Stream, grid, block Dim3, sharedMem uint32, args *Args) error {
	params := args.pointers()
	var pp unsafe.Pointer
	if len(params) > 0 {
		pp = unsafe.Pointer(&params[0])
	}
	err := f.m.dv.call("cuLaunchKernel", func() int32 {
		return f.m.dv.drv.api.cuLaunchKernel(f.h, max(grid.X, 1), max(grid.Y, 1), max(grid.Z, 1),
			max(block.X, 1), max(block.Y, 1), max(block.Z, 1), sharedMem, s.h, pp, nil)
	})
	runtime.KeepAlive(params)
	runtime.KeepAlive(args)
	if err != nil {
		return fmt.Errorf("launching %s: %w", f.Name, err)
	}
	return nil
}
