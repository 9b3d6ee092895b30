// Package cpu is sonard's CPU backend: segments are POSIX shared memory
// mapped by package ipcbridge, tensors are optimizer.Tensor updated in place
// by optimizer.Engine with the float32 square root of each client's torch.
package cpu

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"

	"github.com/sonar-moe/sonar/backend"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
)

// Backend maps shared memory with Mapper and updates it with Workers
// goroutines per tensor.
type Backend struct {
	Mapper  ipcbridge.Mapper
	Workers int
	// MinChunk is the smallest number of elements worth a goroutine (0:
	// the engine's default).
	MinChunk int
	// Spin is how long idle workers poll for the next tensor (the engine's
	// Spin: 0 its default, negative never).
	Spin time.Duration
	// Steer keeps the workers helping a request's goroutine off its CPU
	// (the engine's Steer).
	Steer bool

	phases optimizer.Phases // of every session's engine, and of the page checks
}

// New returns a CPU backend (workers <= 0: one per core).
func New(m ipcbridge.Mapper, workers int) *Backend {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	return &Backend{Mapper: m, Workers: workers}
}

var _ backend.Backend = (*Backend)(nil)

// Name implements backend.Backend.
func (b *Backend) Name() string { return "cpu" }

// Memory implements backend.Backend: shared memory and the server's heap.
func (b *Backend) Memory() backend.Memory { return backend.Host }

// Describe implements backend.Backend.
func (b *Backend) Describe() string { return fmt.Sprintf("CPU, %d workers", b.Workers) }

// Stats implements backend.Backend: where the updates' time went.
func (b *Backend) Stats() backend.Stats {
	return backend.Stats{CheckSeconds: b.phases.Check().Seconds(), ReadSeconds: b.phases.Read().Seconds(),
		KernelSeconds: b.phases.Kernel().Seconds()}
}

// Close implements backend.Backend.
func (b *Backend) Close() error { return nil }

// Open implements backend.Backend: the session's engine uses the client's
// square root.
func (b *Backend) Open(c backend.Client) (backend.Session, error) {
	e := optimizer.NewEngine()
	e.Workers = b.Workers
	e.Spin = b.Spin
	e.Steer = b.Steer
	e.Phases = &b.phases
	if b.MinChunk > 0 {
		e.MinChunk = b.MinChunk
	}
	e.Sqrt = c.Sqrt
	if c.SqrtName != "" {
		e.SqrtName = c.SqrtName
	}
	return &session{b: b, engine: e, segments: map[*segment]struct{}{}}, nil
}

type segment struct {
	m     ipcbridge.Mapping
	addr  uintptr  // where it is mapped in this process (to name a fault's segment)
	owner *session // forgets the segment when it is closed (detached)
}

func (s *segment) Name() string  { return s.m.Name() }
func (s *segment) Size() int64   { return s.m.Size() }
func (s *segment) Object() any   { return s.m.Object() }
func (s *segment) Base() uint64  { return 0 } // a segment maps its file from offset 0
func (s *segment) Verify() error { return s.m.Verify() }
func (s *segment) Check(off, n, align int64) error {
	_, err := s.m.Bytes(off, n, align)
	return err
}

// Close unmaps the segment (a detach, or the end of its session) and removes
// it from its session's segments.
func (s *segment) Close() error {
	if s.owner != nil {
		delete(s.owner.segments, s)
		s.owner = nil
	}
	return s.m.Close()
}

// bytes is the memory of a reference the server resolved.
func bytesOf(r backend.Ref) ([]byte, error) {
	s, ok := r.Seg.(*segment)
	if !ok {
		return nil, fmt.Errorf("segment %s is not shared memory (a client's own memory holds gradients only)", r.Seg.Name())
	}
	return s.m.Bytes(r.Off, r.Len, 1)
}

// procSegment is the client's own address space (AttachProcess): a
// reference's offset is an address there. It holds gradients only.
type procSegment struct{ pm *ipcbridge.ProcessMemory }

// procObject identifies a process's memory: it never overlaps a file.
type procObject struct{ pid int }

func (p *procSegment) Name() string  { return fmt.Sprintf("process %d", p.pm.PID()) }
func (p *procSegment) Size() int64   { return 0 } // nothing is mapped
func (p *procSegment) Object() any   { return procObject{p.pm.PID()} }
func (p *procSegment) Base() uint64  { return 0 }
func (p *procSegment) Verify() error { return nil } // each range is checked when a step reads it
func (p *procSegment) Close() error  { return p.pm.Close() }

func (p *procSegment) Check(off, n, align int64) error {
	switch {
	case off <= 0 || n < 0 || off > math.MaxInt64-n:
		return fmt.Errorf("address 0x%x+%d of %s is out of range", off, n, p.Name())
	case align > 1 && off%align != 0:
		return fmt.Errorf("address 0x%x of %s is not aligned to %d bytes", off, p.Name(), align)
	}
	return nil
}

// procGrad reads one gradient from the client's memory.
type procGrad struct {
	pm   *ipcbridge.ProcessMemory
	addr uint64
}

func (g procGrad) ReadGrad(dst []byte, off int) error { return g.pm.ReadAt(dst, g.addr+uint64(off)) }

// gradOf is how the engine gets a reference's gradient: a slice of shared
// memory, or a reader of the client's memory whose every page was checked
// (each page once a request: proven holds the pages proven so far).
func (b *Backend) gradOf(r backend.Ref, proven map[*procSegment]*ipcbridge.Pages) ([]byte, optimizer.GradReader, error) {
	if p, ok := r.Seg.(*procSegment); ok {
		pages := proven[p]
		if pages == nil {
			pages = p.pm.Pages()
			proven[p] = pages
		}
		t0 := time.Now()
		err := pages.Check(uint64(r.Off), r.Len)
		b.phases.AddCheck(t0)
		if err != nil {
			return nil, nil, err
		}
		return nil, procGrad{p.pm, uint64(r.Off)}, nil
	}
	buf, err := bytesOf(r)
	return buf, nil, err
}

type tensor struct{ *optimizer.Tensor }

func (t tensor) Step() int64       { return t.Tensor.Step }
func (t tensor) Pending() int      { return t.Tensor.Pending() }
func (t tensor) StateBytes() int64 { return int64(t.Tensor.StateBytes()) }
func (t tensor) Damage() error     { return t.Tensor.Damage() }

type session struct {
	b        *Backend
	engine   *optimizer.Engine
	segments map[*segment]struct{} // attached and not yet closed
	tensors  []*optimizer.Tensor
}

// explain adds to a memory fault which segment the address lies in.
func (s *session) explain(err error) error {
	var fe *optimizer.FaultError
	if !errors.As(err, &fe) {
		return err
	}
	for seg := range s.segments {
		if seg.m == nil || fe.Fault.Addr < seg.addr || fe.Fault.Addr-seg.addr >= uintptr(seg.Size()) {
			continue
		}
		why := "its file is intact now"
		if verr := seg.m.Verify(); verr != nil {
			why = verr.Error()
		}
		return fmt.Errorf("%w (the address is byte %d of shared-memory segment %s: %s)", err, fe.Fault.Addr-seg.addr, seg.Name(), why)
	}
	return err
}

func (s *session) Attach(handle []byte, size int64) (backend.Segment, error) {
	m, err := s.b.Mapper.Map(string(handle), size)
	if err != nil {
		return nil, err
	}
	b, err := m.Bytes(0, m.Size(), 1)
	if err != nil {
		_ = m.Close()
		return nil, err
	}
	seg := &segment{m: m, addr: uintptr(unsafe.Pointer(&b[0])), owner: s}
	s.segments[seg] = struct{}{}
	return seg, nil
}

// AttachProcess implements backend.ProcessAttacher.
func (s *session) AttachProcess(pid int, probeAddr uint64, probe []byte) (backend.Segment, error) {
	pm, err := ipcbridge.OpenProcess(pid, probeAddr, probe)
	if err != nil {
		return nil, err
	}
	return &procSegment{pm}, nil
}

func (s *session) SetEvent([]byte) error {
	return errors.New("cuda_event is for CUDA tensors: this session's tensors are shared memory")
}

func (s *session) Create(specs []backend.Spec) ([]backend.Tensor, error) {
	out := make([]backend.Tensor, 0, len(specs))
	for _, sp := range specs {
		mem, err := bytesOf(sp.Param)
		if err != nil {
			return nil, fmt.Errorf("tensor %q param: %w", sp.Name, err)
		}
		t, err := optimizer.NewTensor(sp.Name, sp.DType, int(sp.Numel), sp.Hyper, mem)
		if err != nil {
			for _, made := range out { // all or none
				made.(tensor).Free()
			}
			return nil, err
		}
		out = append(out, tensor{t})
	}
	for _, t := range out {
		s.tensors = append(s.tensors, t.(tensor).Tensor)
	}
	return out, nil
}

func own(t backend.Tensor) (*optimizer.Tensor, error) {
	ct, ok := t.(tensor)
	if !ok {
		return nil, fmt.Errorf("tensor %T is not a CPU tensor", t)
	}
	return ct.Tensor, nil
}

func (s *session) Step(items []backend.Item, waitEvent bool) error {
	if waitEvent {
		return errors.New("wait_event is for CUDA tensors only")
	}
	// Start the engine's other workers now, where the largest tensor needs
	// them: they are running by the time the gradients are checked and the
	// arithmetic starts (optimizer/helpers.go).
	largest := 0
	for _, it := range items {
		if t, err := own(it.Tensor); err == nil {
			largest = max(largest, t.Numel)
		}
	}
	s.engine.Prewake(largest)
	type work struct {
		t    *optimizer.Tensor
		grad []byte
		read optimizer.GradReader
		it   backend.Item
	}
	ws := make([]work, 0, len(items))
	proven := map[*procSegment]*ipcbridge.Pages{}
	for _, it := range items {
		t, err := own(it.Tensor)
		if err != nil {
			return err
		}
		w := work{t: t, it: it}
		if it.Grad != nil {
			if w.grad, w.read, err = s.b.gradOf(*it.Grad, proven); err != nil {
				return fmt.Errorf("tensor %s grad: %w", t.Name, err)
			}
		}
		ws = append(ws, w)
	}
	for i, w := range ws {
		var err error
		switch {
		case w.read != nil && w.it.Apply:
			var sq float64
			sq, err = s.engine.ApplyFromScaled(w.t, w.read, w.it.Scalars, w.it.Prep)
			if w.it.SqNorm != nil {
				*w.it.SqNorm = sq
			}
		case w.read != nil:
			err = s.engine.AccumulateFrom(w.t, w.read)
		case w.it.Apply:
			var sq float64
			sq, err = s.engine.ApplyScaled(w.t, w.grad, w.it.Scalars, w.it.Prep)
			if w.it.SqNorm != nil {
				*w.it.SqNorm = sq
			}
		default:
			err = s.engine.Accumulate(w.t, w.grad)
		}
		if err != nil {
			// The server validated every item: a memory fault (the client
			// shrank a segment during the request), a read of the client's
			// memory that failed after its check, or allocation failure.
			return fmt.Errorf("item %d of %d: %w; items before it were done, items after it were not started",
				i, len(ws), s.explain(err))
		}
	}
	return nil
}

func stateBytes(t *optimizer.Tensor, refs []backend.Ref) ([3][]byte, error) {
	var out [3][]byte
	want := 2
	if t.Hyper.Amsgrad {
		want = 3
	}
	if len(refs) != want {
		return out, fmt.Errorf("tensor %s: %d state buffers given, %d needed", t.Name, len(refs), want)
	}
	for i, r := range refs {
		b, err := bytesOf(r)
		if err != nil {
			return out, fmt.Errorf("tensor %s state part %d: %w", t.Name, i, err)
		}
		out[i] = b
	}
	return out, nil
}

func (s *session) Export(bt backend.Tensor, dst []backend.Ref) error {
	t, err := own(bt)
	if err != nil {
		return err
	}
	mem, err := stateBytes(t, dst)
	if err != nil {
		return err
	}
	return s.explain(t.ExportState(mem[0], mem[1], mem[2]))
}

func (s *session) Import(bt backend.Tensor, step int64, src []backend.Ref) error {
	t, err := own(bt)
	if err != nil {
		return err
	}
	mem, err := stateBytes(t, src)
	if err != nil {
		return err
	}
	return s.explain(t.ImportState(step, mem[0], mem[1], mem[2]))
}

func (s *session) Discard(bt backend.Tensor) (bool, error) {
	t, err := own(bt)
	if err != nil {
		return false, err
	}
	return t.Discard(), nil
}

func (s *session) Close() error {
	for _, t := range s.tensors {
		t.Free()
	}
	s.tensors = nil
	var errs []error
	for seg := range s.segments {
		errs = append(errs, seg.Close()) // deletes seg from the map
	}
	return errors.Join(errs...)
}

// State returns the engine tensor behind a tensor of this backend (its
// parameter memory and state), false for a tensor of another backend.
func State(t backend.Tensor) (*optimizer.Tensor, bool) {
	ct, ok := t.(tensor)
	return ct.Tensor, ok
}
