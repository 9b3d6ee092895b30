// Package backend is the one interface between sonard's sessions (package
// server) and the memory they update in place. A Backend is one kind of
// memory: POSIX shared memory updated by the CPU engine (package
// backend/cpu), or a client's CUDA memory opened by IPC handle and updated by
// the device engine (package backend/gpu). The server picks a backend once,
// when a client attaches a segment; the tensors registered in that segment
// belong to the same backend, and nothing else in the server branches on it.
//
// The checks every backend needs are written here once: resolving a
// reference inside a segment (bounds and alignment) and the overlap test of
// two references. Implementations never import each other, as gonum's blas
// implementations sit beside its interface package.
package backend

import (
	"fmt"
	"strings"

	"github.com/sonar-moe/sonar/optimizer"
)

// Segment is client memory a backend attached.
type Segment interface {
	// Name identifies the segment in messages ("sonar-…", "cuda:…").
	Name() string
	// Size is its length in bytes.
	Size() int64
	// Object is the memory the segment is part of, a comparable value (a
	// shared-memory file's device and inode; nil where one address space
	// holds every segment, as a device's); Base is the position of the
	// segment's first byte in it (a file offset, a device address). Both
	// serve only to detect overlaps: two attachments of one file (a second
	// name, a hard link) are the same memory.
	Object() any
	Base() uint64
	// Verify reports whether the memory is still all there (the client did
	// not shrink it since it was attached); cheap enough for every request.
	Verify() error
	// Check reports whether [off, off+n) lies inside the segment with off
	// aligned to align bytes, and whether the segment is still open.
	Check(off, n, align int64) error
	// Close detaches the memory; references into it must not be used after.
	Close() error
}

// Ref is a checked range of a segment.
type Ref struct {
	Seg      Segment
	Off, Len int64
}

// Resolve checks [off, off+n) of seg (alignment align) and returns it.
func Resolve(seg Segment, off, n, align int64) (Ref, error) {
	if err := seg.Check(off, n, align); err != nil {
		return Ref{}, err
	}
	return Ref{Seg: seg, Off: off, Len: n}, nil
}

// Overlaps reports whether r and o share a byte: they lie in one memory
// object (whatever segments name it) and their ranges in it intersect. Both
// must belong to one backend.
func (r Ref) Overlaps(o Ref) bool {
	if r.Seg == nil || o.Seg == nil || r.Len <= 0 || o.Len <= 0 || r.Seg.Object() != o.Seg.Object() {
		return false
	}
	a0, b0 := r.Seg.Base()+uint64(r.Off), o.Seg.Base()+uint64(o.Off)
	return a0 < b0+uint64(o.Len) && b0 < a0+uint64(r.Len)
}

// Spec describes a tensor to register: its parameter memory (checked) and
// its AdamW hyper-parameters.
type Spec struct {
	Name  string
	DType optimizer.DType
	Numel int64
	Hyper optimizer.Hyper
	Param Ref
}

// Tensor is a registered tensor as the server sees it; each backend keeps
// its own state behind it.
type Tensor interface {
	// Step is the number of AdamW steps applied (the engine counts them).
	Step() int64
	// Pending is the number of accumulated micro-batch gradients not yet applied.
	Pending() int
	// StateBytes is the memory the backend holds for the tensor.
	StateBytes() int64
	// Damage is nil for an intact tensor, else why its parameter and
	// state may be partly updated (a memory fault interrupted an update);
	// such a tensor refuses steps and exports until its state is imported
	// (or, when the fault spoiled only the accumulated sum, it is discarded).
	Damage() error
}

// Item is one tensor of a step request, validated by the server: Grad nil
// applies what was accumulated; Apply false accumulates Grad.
type Item struct {
	Tensor  Tensor
	Grad    *Ref
	Apply   bool
	Scalars optimizer.Scalars
	// Prep (with Apply) asks for the applied gradient's squared norm and
	// scales it before the AdamW arithmetic; the zero value does nothing.
	// SqNorm receives the norm when Prep.Norm is set.
	Prep   optimizer.GradPrep
	SqNorm *float64
}

// Client is what a backend needs to know of a session's client.
type Client struct {
	// Name is the transport's identity of the client (for logs).
	Name string
	// Sqrt is the float32 square root of the client's torch (the zero
	// value: IEEE) and SqrtName says which ("ieee", "mkl:<library>").
	Sqrt     optimizer.Sqrt
	SqrtName string
}

// Session is one client's use of a backend: the segments it attached, the
// tensors it registered and any per-client objects (a CUDA event).
type Session interface {
	// Attach maps the memory handle names (a shared-memory name, a CUDA IPC
	// handle); size is the number of bytes the client will use.
	Attach(handle []byte, size int64) (Segment, error)
	// SetEvent opens the client's interprocess event that steps with
	// waitEvent wait for.
	SetEvent(handle []byte) error
	// Create makes the state of every spec, all or none.
	Create(specs []Spec) ([]Tensor, error)
	// Step applies or accumulates every item; after an error that is not a
	// refusal the error says whether memory may be partly updated.
	Step(items []Item, waitEvent bool) error
	// Export copies t's state (exp_avg, exp_avg_sq[, max_exp_avg_sq]) to dst.
	Export(t Tensor, dst []Ref) error
	// Import replaces t's state and step count with src.
	Import(t Tensor, step int64, src []Ref) error
	// Discard drops t's accumulated gradients not yet applied (and a
	// damage mark that concerns that sum alone), leaving its parameter,
	// state and step count as they are; it reports whether anything was
	// pending. It cannot fail for a tensor of the session.
	Discard(t Tensor) (bool, error)
	// Close frees every tensor's state and closes the session's segments
	// and events.
	Close() error
}

// ProcessAttacher is a Session that can also read gradients where they lie
// in its client's own memory (the CPU backend, ipcbridge.ProcessMemory).
// pid comes from the connection, never from the client; the probe's bytes
// must be found at probeAddr. The segment it returns holds gradients only:
// its Size is 0 and its offsets are the client's addresses.
type ProcessAttacher interface {
	AttachProcess(pid int, probeAddr uint64, probe []byte) (Segment, error)
}

// Stats are a backend's own counters (beyond its sessions' tensors).
type Stats struct {
	IPCOpen      int   // CUDA allocations open in the IPC cache
	IPCOpenBytes int64 // their bytes
	IPCOpens     int64 // opens since start
	// CPU path, since start (wall time added over the workers): checking
	// that a client's gradient pages are readable, copying them out of the
	// client's process, and the AdamW arithmetic.
	CheckSeconds, ReadSeconds, KernelSeconds float64
}

// Memory is where a backend's segments and tensor state lie, which decides
// what bounds them: the server's accounting asks this instead of a
// backend's name.
type Memory int

const (
	// Host is the machine's memory: shared-memory segments and state in
	// the server's heap, which the server's state budgets
	// (Server.MaxStateBytes, MaxSessionStateBytes) bound.
	Host Memory = iota
	// Device is a GPU's memory, which the device's own allocator bounds.
	Device
)

// Backend is one kind of memory the server updates.
type Backend interface {
	// Name is the backend's name in logs and stats ("cpu", "cuda").
	Name() string
	// Memory says where its segments and tensor state lie.
	Memory() Memory
	// Describe says what runs the updates (hello's "cuda" field).
	Describe() string
	// Open starts a client's session.
	Open(c Client) (Session, error)
	// Stats returns the backend's counters.
	Stats() Stats
	// Close releases the backend (after every session was closed).
	Close() error
}

// ErrUnavailable answers requests for a backend the server does not have.
type ErrUnavailable struct{ Name, Why string }

func (e *ErrUnavailable) Error() string {
	return fmt.Sprintf("this sonard has no %s path (%s)", strings.ToUpper(e.Name), e.Why)
}
