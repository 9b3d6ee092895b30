// Package cpu is sonard's CPU backend: segments are POSIX shared memory
// mapped by package ipcbridge, tensors are optimizer.Tensor updated in place
// by optimizer.Engine with the float32 square root of each client's torch.
package cpu

import (
	"errors"
	"fmt"
	"runtime"
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

// Describe implements backend.Backend.
func (b *Backend) Describe() string { return fmt.Sprintf("CPU, %d workers", b.Workers) }

// Stats implements backend.Backend (the CPU backend has no counters of its own).
func (b *Backend) Stats() backend.Stats { return backend.Stats{} }

// Close implements backend.Backend.
func (b *Backend) Close() error { return nil }

// Open implements backend.Backend: the session's engine uses the client's
// square root.
func (b *Backend) Open(c backend.Client) (backend.Session, error) {
	e := optimizer.NewEngine()
	e.Workers = b.Workers
	if b.MinChunk > 0 {
		e.MinChunk = b.MinChunk
	}
	e.Sqrt = c.Sqrt
	if c.SqrtName != "" {
		e.SqrtName = c.SqrtName
	}
	return &session{b: b, engine: e}, nil
}

type segment struct {
	m    ipcbridge.Mapping
	base uint64
}

func (s *segment) Name() string { return s.m.Name() }
func (s *segment) Size() int64  { return s.m.Size() }
func (s *segment) Base() uint64 { return s.base }
func (s *segment) Close() error { return s.m.Close() }

func (s *segment) Check(off, n, align int64) error {
	_, err := s.m.Bytes(off, n, align)
	return err
}

// bytes is the memory of a reference the server resolved.
func bytesOf(r backend.Ref) ([]byte, error) {
	s, ok := r.Seg.(*segment)
	if !ok {
		return nil, fmt.Errorf("segment %s is not shared memory", r.Seg.Name())
	}
	return s.m.Bytes(r.Off, r.Len, 1)
}

type tensor struct{ *optimizer.Tensor }

func (t tensor) Step() int64       { return t.Tensor.Step }
func (t tensor) Pending() int      { return t.Tensor.Pending() }
func (t tensor) StateBytes() int64 { return int64(t.Tensor.StateBytes()) }

type session struct {
	b        *Backend
	engine   *optimizer.Engine
	segments []*segment
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
	seg := &segment{m: m, base: uint64(uintptr(unsafe.Pointer(&b[0])))}
	s.segments = append(s.segments, seg)
	return seg, nil
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
			return nil, err
		}
		out = append(out, tensor{t})
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
	type work struct {
		t    *optimizer.Tensor
		grad []byte
		it   backend.Item
	}
	ws := make([]work, 0, len(items))
	for _, it := range items {
		t, err := own(it.Tensor)
		if err != nil {
			return err
		}
		var grad []byte
		if it.Grad != nil {
			if grad, err = bytesOf(*it.Grad); err != nil {
				return fmt.Errorf("tensor %s grad: %w", t.Name, err)
			}
		}
		ws = append(ws, work{t, grad, it})
	}
	for _, w := range ws {
		var err error
		if w.it.Apply {
			err = s.engine.Apply(w.t, w.grad, w.it.Scalars)
		} else {
			err = s.engine.Accumulate(w.t, w.grad)
		}
		if err != nil { // the server validated every item: only an engine bug gets here
			return fmt.Errorf("tensor %s: %w", w.t.Name, err)
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
	copy(mem[0], t.ExpAvg)
	copy(mem[1], t.ExpAvgSq)
	if t.Hyper.Amsgrad {
		copy(mem[2], t.MaxExpAvgSq)
	}
	return nil
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
	return t.ImportState(step, mem[0], mem[1], mem[2])
}

func (s *session) Close() error {
	var errs []error
	for _, seg := range s.segments {
		errs = append(errs, seg.Close())
	}
	s.segments = nil
	return errors.Join(errs...)
}

// State returns the engine tensor behind a tensor of this backend (its
// parameter memory and state), false for a tensor of another backend.
func State(t backend.Tensor) (*optimizer.Tensor, bool) {
	ct, ok := t.(tensor)
	return ct.Tensor, ok
}
