// Package gpu is sonard's CUDA backend: segments are a client's CUDA
// allocations opened by IPC handle (package ipcbridge, through one IPC cache
// per device), tensors are optimizer/device tensors updated in place by the
// device engine's kernels, and each session may hand over an interprocess
// event that steps wait for. Open assembles the whole path from a device
// ordinal; without a driver it reports ErrNoCUDA.
package gpu

import (
	"errors"
	"fmt"

	"github.com/sonar-moe/sonar/backend"
	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/optimizer/device"
)

// ErrNoCUDA is returned (wrapped) by Open where the machine has no CUDA
// driver or no such device.
var ErrNoCUDA = errors.New("no CUDA device")

// Backend is one CUDA device's update path.
type Backend struct {
	dev    *cuda.Device
	engine *device.Engine
	cache  *cuda.IPCCache
	mapper ipcbridge.DeviceMapper
}

// Open opens device ordinal of the driver, compiles and loads the kernels
// (NVRTC, with the given loads) and makes an IPC cache keeping at most
// maxIdle unused client allocations open. Errors match ErrNoCUDA (and
// cuda.ErrNoDriver) where there is no driver or device.
func Open(ordinal, maxIdle int, loads device.Loads) (*Backend, error) {
	if maxIdle < 0 {
		return nil, fmt.Errorf("max idle allocations %d: want >= 0", maxIdle)
	}
	dev, err := cuda.OpenDevice(ordinal)
	if err != nil {
		if errors.Is(err, cuda.ErrNoDriver) || errors.Is(err, cuda.ErrNoDevice) {
			return nil, fmt.Errorf("%w: %w", ErrNoCUDA, err)
		}
		return nil, fmt.Errorf("opening CUDA device %d: %w", ordinal, err)
	}
	nv, err := cuda.OpenNVRTC()
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	eng, err := device.NewEngine(dev, nv, loads)
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	return New(dev, eng, maxIdle), nil
}

// New assembles a backend from an opened device and engine (tests use the
// stand-in driver of cuda/cudatest); Close closes both.
func New(dev *cuda.Device, eng *device.Engine, maxIdle int) *Backend {
	cache := cuda.NewIPCCache(dev, maxIdle)
	return &Backend{dev: dev, engine: eng, cache: cache, mapper: ipcbridge.NewCUDAMapper(cache)}
}

var _ backend.Backend = (*Backend)(nil)

// Name implements backend.Backend.
func (b *Backend) Name() string { return "cuda" }

// Memory implements backend.Backend: the client's CUDA memory and the state
// the engine allocates on the device.
func (b *Backend) Memory() backend.Memory { return backend.Device }

// Describe implements backend.Backend, e.g. "NVIDIA H200, cc 9.0, compute_90, scalar loads".
func (b *Backend) Describe() string { return b.engine.Describe() }

// Stats implements backend.Backend: the IPC cache's counters.
func (b *Backend) Stats() backend.Stats {
	cs := b.cache.Stats()
	return backend.Stats{IPCOpen: cs.Open, IPCOpenBytes: cs.Bytes, IPCOpens: cs.Opens}
}

// Close closes the IPC cache, the engine and the device.
func (b *Backend) Close() error {
	return errors.Join(b.cache.Close(), b.engine.Close(), b.dev.Close())
}

// Open implements backend.Backend.
func (b *Backend) Open(backend.Client) (backend.Session, error) {
	return &session{b: b, segments: map[*segment]struct{}{}}, nil
}

type segment struct {
	m     ipcbridge.DeviceMapping
	base  cuda.DevicePtr
	owner *session // forgets the segment when it is closed (detached)
}

func (s *segment) Name() string { return s.m.Name() }
func (s *segment) Size() int64  { return s.m.Size() }
func (s *segment) Base() uint64 { return uint64(s.base) }

// Object implements backend.Segment: device addresses are one space (an
// allocation opened twice is cached and maps to one address).
func (s *segment) Object() any { return nil }

// Verify implements backend.Segment (a client cannot shrink a CUDA allocation
// the server holds open).
func (s *segment) Verify() error { return nil }

// Close closes the allocation (a detach, or the end of its session) and
// removes it from its session's segments.
func (s *segment) Close() error {
	if s.owner != nil {
		delete(s.owner.segments, s)
		s.owner = nil
	}
	return s.m.Close()
}

func (s *segment) Check(off, n, align int64) error {
	_, err := s.m.Ptr(off, n, align)
	return err
}

func ptrOf(r backend.Ref) (cuda.DevicePtr, error) {
	s, ok := r.Seg.(*segment)
	if !ok {
		return 0, fmt.Errorf("segment %s is not CUDA memory", r.Seg.Name())
	}
	return s.m.Ptr(r.Off, r.Len, 1)
}

type tensor struct{ *device.Tensor }

func (t tensor) Step() int64       { return t.Tensor.Step }
func (t tensor) Pending() int      { return t.Tensor.Pending() }
func (t tensor) StateBytes() int64 { return t.Tensor.StateBytes() }
func (t tensor) Damage() error     { return nil }

func own(t backend.Tensor) (*device.Tensor, error) {
	gt, ok := t.(tensor)
	if !ok {
		return nil, fmt.Errorf("tensor %T is not a CUDA tensor", t)
	}
	return gt.Tensor, nil
}

type session struct {
	b        *Backend
	segments map[*segment]struct{} // attached and not yet closed
	tensors  []*device.Tensor
	event    *cuda.Event
}

func (s *session) Attach(handle []byte, size int64) (backend.Segment, error) {
	m, err := s.b.mapper.MapDevice(handle, size)
	if err != nil {
		return nil, err
	}
	base, err := m.Ptr(0, m.Size(), 1)
	if err != nil {
		_ = m.Close()
		return nil, err
	}
	seg := &segment{m: m, base: base, owner: s}
	s.segments[seg] = struct{}{}
	return seg, nil
}

func (s *session) SetEvent(handle []byte) error {
	var h cuda.IPCEventHandle
	if len(handle) != len(h.Reserved) {
		return fmt.Errorf("event handle is %d bytes, want %d", len(handle), len(h.Reserved))
	}
	copy(h.Reserved[:], handle)
	ev, err := s.b.dev.OpenIPCEvent(h)
	if err != nil {
		return err
	}
	if s.event != nil {
		if err := s.event.Destroy(); err != nil {
			_ = ev.Destroy()
			return fmt.Errorf("destroying the previous event: %w", err)
		}
	}
	s.event = ev
	return nil
}

func (s *session) Create(specs []backend.Spec) ([]backend.Tensor, error) {
	made := make([]*device.Tensor, 0, len(specs))
	fail := func(err error) ([]backend.Tensor, error) {
		for _, t := range made {
			_ = s.b.engine.Free(t)
		}
		return nil, err
	}
	for _, sp := range specs {
		p, err := ptrOf(sp.Param)
		if err != nil {
			return fail(fmt.Errorf("tensor %q param: %w", sp.Name, err))
		}
		t, err := s.b.engine.NewTensor(sp.Name, sp.DType, sp.Numel, sp.Hyper, p)
		if err != nil {
			return fail(err)
		}
		made = append(made, t)
	}
	out := make([]backend.Tensor, len(made))
	for i, t := range made {
		out[i] = tensor{t}
	}
	s.tensors = append(s.tensors, made...)
	return out, nil
}

func (s *session) Step(items []backend.Item, waitEvent bool) error {
	if waitEvent && s.event == nil {
		return errors.New("wait_event set but the session sent no cuda_event")
	}
	work := make([]device.Item, 0, len(items))
	for _, it := range items {
		t, err := own(it.Tensor)
		if err != nil {
			return err
		}
		if it.Prep != (optimizer.GradPrep{}) || it.SqNorm != nil {
			return fmt.Errorf("tensor %s: gradient norms and scales (expert clipping) are not implemented for CUDA tensors", t.Name)
		}
		var grad cuda.DevicePtr
		if it.Grad != nil {
			if grad, err = ptrOf(*it.Grad); err != nil {
				return fmt.Errorf("tensor %s grad: %w", t.Name, err)
			}
		}
		work = append(work, device.Item{T: t, Grad: grad, Apply: it.Apply, Scalars: it.Scalars})
	}
	var wait *cuda.Event
	if waitEvent {
		wait = s.event
	}
	return s.b.engine.Step(wait, work)
}

func ptrs(refs []backend.Ref) ([]cuda.DevicePtr, error) {
	out := make([]cuda.DevicePtr, len(refs))
	for i, r := range refs {
		p, err := ptrOf(r)
		if err != nil {
			return nil, fmt.Errorf("state part %d: %w", i, err)
		}
		out[i] = p
	}
	return out, nil
}

func (s *session) Export(bt backend.Tensor, dst []backend.Ref) error {
	t, err := own(bt)
	if err != nil {
		return err
	}
	p, err := ptrs(dst)
	if err != nil {
		return fmt.Errorf("tensor %s %w", t.Name, err)
	}
	return s.b.engine.Export(t, p)
}

func (s *session) Import(bt backend.Tensor, step int64, src []backend.Ref) error {
	t, err := own(bt)
	if err != nil {
		return err
	}
	p, err := ptrs(src)
	if err != nil {
		return fmt.Errorf("tensor %s %w", t.Name, err)
	}
	return s.b.engine.Import(t, step, p)
}

func (s *session) Discard(bt backend.Tensor) (bool, error) {
	t, err := own(bt)
	if err != nil {
		return false, err
	}
	return s.b.engine.Discard(t), nil
}

// Close frees the session's device state, closes its allocations and its
// event. Every request waited for its kernels, so none is running.
func (s *session) Close() error {
	var errs []error
	for _, t := range s.tensors {
		errs = append(errs, s.b.engine.Free(t))
	}
	for seg := range s.segments {
		errs = append(errs, seg.Close()) // deletes seg from the map
	}
	if s.event != nil {
		errs = append(errs, s.event.Destroy())
	}
	s.tensors, s.event = nil, nil
	return errors.Join(errs...)
}
