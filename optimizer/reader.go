package optimizer

import (
	"fmt"
	"sync"
	"time"
)

// GradReader is a gradient the server cannot address: another process's
// memory, copied piece by piece (package ipcbridge's ProcessMemory). ReadGrad
// copies bytes [off, off+len(dst)) of the gradient into dst, or fails
// without a partial copy being used.
type GradReader interface {
	ReadGrad(dst []byte, off int) error
}

// readBytes is how much of a gradient a worker reads at a time (one
// process_vm_readv): a whole number of 64-element blocks of either dtype,
// so the pieces start where a whole-tensor pass would be (the fused
// kernels' vector tails are the tensor's), and small enough that the piece
// is still in the core's cache (L2) when the arithmetic reads it, so
// reading the gradient costs about what reading it in place would. Each
// call costs about 2 us beside the 0.4-1 us a 4 KiB page takes: 128 KiB
// pieces instead of 8192 elements (32 KiB of float32, 16 KiB of bfloat16)
// took a 16M-element bfloat16 request from 10.8 to 9.0 ms and a float32
// one from 17.2 to 16.7 (`bench/kernel.py`'s sonard end to end, medians of
// four alternating rounds, 2026-12-05).
const readBytes = 128 << 10

// readPiece is how many elements of d a worker reads at a time.
func readPiece(d DType) int { return readBytes / d.Size() }

// readScratch holds a worker's piece of gradient, reused across requests.
var readScratch = sync.Pool{New: func() any { return new([readBytes]byte) }}

// ReadError is a gradient read that failed part way through an update.
type ReadError struct {
	Tensor string
	Op     string // "apply" or "accumulate"
	Err    error
}

func (e *ReadError) Error() string {
	if e.Op == "accumulate" {
		return fmt.Sprintf("tensor %q: %s interrupted by a failed gradient read (%v); its accumulated gradient is partly "+
			"summed and was dropped (parameter and state intact): the tensor refuses updates and exports until its pending "+
			"gradients are discarded (zero_grad) or its state is imported again (load_state_dict)", e.Tensor, e.Op, e.Err)
	}
	return fmt.Sprintf("tensor %q: %s interrupted by a failed gradient read (%v); its parameter and optimizer state "+
		"may be partly updated: the tensor refuses updates and exports until its state is imported again (load_state_dict)",
		e.Tensor, e.Op, e.Err)
}

func (e *ReadError) Unwrap() error { return e.Err }

// ApplyFrom is Apply with the gradient read from r. Callers check r's whole
// range first (ipcbridge.ProcessMemory.Check): a read that fails anyway (the
// client unmapped its memory during the request) leaves the tensor damaged,
// as a memory fault does.
func (e *Engine) ApplyFrom(t *Tensor, r GradReader, s Scalars) error {
	_, err := e.ApplyFromScaled(t, r, s, GradPrep{})
	return err
}

// ApplyFromScaled is ApplyScaled with the gradient read from r: each piece
// is measured and scaled in the worker's buffer (the client's memory is
// only read). The squared norm is summed in float64 piece by piece, in the
// order of the pieces.
func (e *Engine) ApplyFromScaled(t *Tensor, r GradReader, s Scalars, prep GradPrep) (float64, error) {
	if err := t.usable(); err != nil {
		return 0, err
	}
	if s.Amsgrad != t.Hyper.Amsgrad {
		return 0, fmt.Errorf("tensor %q: amsgrad=%v in step but registered with amsgrad=%v", t.Name, s.Amsgrad, t.Hyper.Amsgrad)
	}
	if t.accumCount > 0 {
		if err := e.AccumulateFrom(t, r); err != nil {
			return 0, err
		}
		return e.ApplyScaled(t, nil, s, prep)
	}
	var sums positionSums
	failed, err := e.pieces(t, r, func(lo, hi int, g []byte) {
		if prep.active() {
			sums.add(lo, scaleGrad(t.DType, g, prep))
		}
		e.kernel(t, g, s, lo, hi)
	})
	if err != nil {
		return 0, t.faulted("apply", true, err)
	}
	if failed != nil {
		t.damage = &ReadError{Tensor: t.Name, Op: "apply", Err: failed}
		return 0, t.damage
	}
	t.Step++
	return sums.total(), nil
}

// AccumulateFrom is Accumulate with the gradient read from r.
func (e *Engine) AccumulateFrom(t *Tensor, r GradReader) error {
	if err := t.usable(); err != nil {
		return err
	}
	sz := t.DType.Size()
	if t.accumCount == 0 {
		if err := t.ensureAccum(); err != nil {
			return err
		}
		var once firstError
		err := e.parallel(t.Numel, func(lo, hi int) {
			once.set(r.ReadGrad(t.accum[lo*sz:hi*sz], lo*sz))
		})
		if err == nil {
			err = once.err
		}
		if err != nil { // the first copy: nothing was accumulated before, nothing is lost
			t.dropAccum()
			return fmt.Errorf("tensor %q: accumulate: %w", t.Name, err)
		}
	} else {
		failed, err := e.pieces(t, r, t.addToAccum)
		if err != nil {
			return t.faulted("accumulate", true, err)
		}
		if failed != nil {
			t.damage = &ReadError{Tensor: t.Name, Op: "accumulate", Err: failed}
			t.dropAccum()
			return t.damage
		}
	}
	t.accumCount++
	return nil
}

// pieces runs fn over t's elements, each worker in pieces of readPiece
// elements whose gradient r reads into the worker's buffer first. It returns
// the first failed read (its chunk stops there; the other chunks finish) and
// parallel's memory fault.
func (e *Engine) pieces(t *Tensor, r GradReader, fn func(lo, hi int, g []byte)) (failed, fault error) {
	sz := t.DType.Size()
	var once firstError
	fault = e.parallel(t.Numel, func(lo, hi int) {
		scratch := readScratch.Get().(*[readBytes]byte)
		defer readScratch.Put(scratch)
		piece := readPiece(t.DType)
		buf := scratch[:min(piece, hi-lo)*sz]
		for a := lo; a < hi; a += piece {
			b := min(a+piece, hi)
			g := buf[:(b-a)*sz]
			var t0 time.Time
			if e.Phases != nil {
				t0 = time.Now()
			}
			err := r.ReadGrad(g, a*sz)
			if e.Phases != nil {
				since(&e.Phases.readNanos, t0)
			}
			if err != nil {
				once.set(err)
				return
			}
			fn(a, b, g)
		}
	})
	return once.err, fault
}

// firstError keeps the first non-nil error of several goroutines.
type firstError struct {
	mu  sync.Mutex
	err error
}

func (f *firstError) set(err error) {
	if err == nil {
		return
	}
	f.mu.Lock()
	if f.err == nil {
		f.err = err
	}
	f.mu.Unlock()
}
