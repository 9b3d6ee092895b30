// Package optimizer is the AdamW engine of Sonar-MoE: it owns the optimizer
// state of each registered tensor (exp_avg, exp_avg_sq, max_exp_avg_sq with
// amsgrad, the step count, and the gradient-accumulation buffer) and applies
// one AdamW step to a whole tensor in one pass over memory, split across
// cores. The per-element math lives in plain functions apart from the
// bookkeeping here, as torch keeps _single_tensor_adam apart from its
// Optimizer class: adamw.go (with kernel_amd64.s) is torch's single-tensor
// arithmetic, which this engine runs, bit for bit that of torch.optim.AdamW
// on CPU for float32 and bfloat16; foreach.go is torch's foreach arithmetic
// and fused_cuda.go its fused CUDA one, which the device engine (package
// optimizer/device) runs on a GPU; fused.go is torch's fused CPU kernel.
package optimizer

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// DType is a tensor element type the engine supports.
type DType uint8

const (
	Float32 DType = iota + 1
	BFloat16
)

// ParseDType maps torch's dtype names ("float32", "bfloat16") to a DType.
func ParseDType(s string) (DType, error) {
	switch s {
	case "float32", "torch.float32":
		return Float32, nil
	case "bfloat16", "torch.bfloat16":
		return BFloat16, nil
	}
	return 0, fmt.Errorf("unsupported dtype %q (want float32 or bfloat16)", s)
}

func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case BFloat16:
		return "bfloat16"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Size is the element size in bytes.
func (d DType) Size() int {
	if d == BFloat16 {
		return 2
	}
	return 4
}

// Tensor is one parameter tensor and its optimizer state. Param is memory
// the engine does not own (shared memory, or a Go slice of the trainer); the
// state buffers are the engine's.
type Tensor struct {
	Name  string
	DType DType
	Numel int
	Hyper Hyper
	Param []byte

	Step        int64
	ExpAvg      []byte
	ExpAvgSq    []byte
	MaxExpAvgSq []byte // only with amsgrad

	accum      []byte // gradient-accumulation buffer, allocated on first use
	accumCount int
}

// Offsets (mod 4 KiB) of the engine's buffers. Fresh large allocations are
// page aligned, as shared-memory parameters are; loads and stores to arrays
// at the same offset mod 4 KiB alias in the CPU's store buffer and run many
// times slower, so each buffer kind gets its own offset.
const (
	offExpAvg   = 1536
	offExpAvgSq = 2560
	offMaxSq    = 3584
	offAccum    = 1024
)

// staggered returns n zeroed bytes starting at the given offset mod 4096.
func staggered(n, off int) []byte {
	buf := make([]byte, n+8192)
	base := int(uintptr(unsafe.Pointer(&buf[0])) % 4096)
	start := (off - base + 8192) % 4096
	return buf[start : start+n : start+n]
}

// NewTensor creates the state for a parameter of numel elements of dtype d
// stored in param (len(param) must be numel*d.Size()).
func NewTensor(name string, d DType, numel int, h Hyper, param []byte) (*Tensor, error) {
	if err := h.Validate(); err != nil {
		return nil, fmt.Errorf("tensor %q: %w", name, err)
	}
	if numel <= 0 {
		return nil, fmt.Errorf("tensor %q: numel %d must be positive", name, numel)
	}
	nb := numel * d.Size()
	if len(param) != nb {
		return nil, fmt.Errorf("tensor %q: param memory is %d bytes, want %d", name, len(param), nb)
	}
	t := &Tensor{Name: name, DType: d, Numel: numel, Hyper: h, Param: param,
		ExpAvg: staggered(nb, offExpAvg), ExpAvgSq: staggered(nb, offExpAvgSq)}
	if h.Amsgrad {
		t.MaxExpAvgSq = staggered(nb, offMaxSq)
	}
	return t, nil
}

// Bytes is the size of the parameter (and of each state buffer) in bytes.
func (t *Tensor) Bytes() int { return t.Numel * t.DType.Size() }

// StateBytes is the memory the engine holds for this tensor.
func (t *Tensor) StateBytes() int {
	n := len(t.ExpAvg) + len(t.ExpAvgSq) + len(t.MaxExpAvgSq) + len(t.accum)
	return n
}

// Pending reports how many accumulated micro-batch gradients wait to be applied.
func (t *Tensor) Pending() int { return t.accumCount }

// Engine applies AdamW steps using up to Workers goroutines per tensor.
type Engine struct {
	Workers int
	// MinChunk is the smallest number of elements worth a goroutine.
	MinChunk int
	// Sqrt is the float32 square root (nil: IEEE); see package vml.
	Sqrt VecSqrt
	// SqrtName says which square root Sqrt is ("ieee" when nil).
	SqrtName string
}

// NewEngine returns an engine using all cores.
func NewEngine() *Engine {
	return &Engine{Workers: runtime.GOMAXPROCS(0), MinChunk: 1 << 16, SqrtName: "ieee"}
}

// Accumulate adds one micro-batch gradient into the tensor's accumulation
// buffer (the first one is copied), as autograd accumulates into .grad.
func (e *Engine) Accumulate(t *Tensor, grad []byte) error {
	if len(grad) != t.Bytes() {
		return fmt.Errorf("tensor %q: gradient is %d bytes, want %d", t.Name, len(grad), t.Bytes())
	}
	if t.accumCount == 0 {
		if t.accum == nil {
			t.accum = staggered(t.Bytes(), offAccum)
		}
		e.parallel(t.Numel, func(lo, hi int) {
			sz := t.DType.Size()
			copy(t.accum[lo*sz:hi*sz], grad[lo*sz:hi*sz])
		})
	} else {
		e.parallel(t.Numel, func(lo, hi int) {
			switch t.DType {
			case Float32:
				AddF32(f32s(t.accum)[lo:hi], f32s(grad)[lo:hi])
			case BFloat16:
				AddBF16(u16s(t.accum)[lo:hi], u16s(grad)[lo:hi])
			}
		})
	}
	t.accumCount++
	return nil
}

// Apply performs one AdamW step. With grad == nil it applies the accumulated
// gradient; otherwise grad is first added to any accumulated gradient. The
// accumulation buffer is released afterwards.
func (e *Engine) Apply(t *Tensor, grad []byte, s Scalars) error {
	if grad != nil && len(grad) != t.Bytes() {
		return fmt.Errorf("tensor %q: gradient is %d bytes, want %d", t.Name, len(grad), t.Bytes())
	}
	if s.Amsgrad != t.Hyper.Amsgrad {
		return fmt.Errorf("tensor %q: amsgrad=%v in step but registered with amsgrad=%v", t.Name, s.Amsgrad, t.Hyper.Amsgrad)
	}
	if grad == nil && t.accumCount == 0 {
		return fmt.Errorf("tensor %q: no gradient to apply", t.Name)
	}
	if grad != nil && t.accumCount > 0 {
		if err := e.Accumulate(t, grad); err != nil {
			return err
		}
		grad = nil
	}
	if grad == nil {
		grad = t.accum
	}
	e.parallel(t.Numel, func(lo, hi int) {
		sz := t.DType.Size()
		a, b := lo*sz, hi*sz
		var vmax []byte
		if s.Amsgrad {
			vmax = t.MaxExpAvgSq[a:b]
		}
		switch {
		case s.Fused && t.DType == Float32:
			FusedStepF32(f32s(t.Param[a:b]), f32s(grad[a:b]), f32s(t.ExpAvg[a:b]), f32s(t.ExpAvgSq[a:b]), f32s(vmax), s, lo, t.Numel)
		case s.Fused:
			FusedStepBF16(u16s(t.Param[a:b]), u16s(grad[a:b]), u16s(t.ExpAvg[a:b]), u16s(t.ExpAvgSq[a:b]), u16s(vmax), s, lo, t.Numel)
		case t.DType == Float32:
			StepF32(f32s(t.Param[a:b]), f32s(grad[a:b]), f32s(t.ExpAvg[a:b]), f32s(t.ExpAvgSq[a:b]), f32s(vmax), s, e.Sqrt)
		default:
			StepBF16(u16s(t.Param[a:b]), u16s(grad[a:b]), u16s(t.ExpAvg[a:b]), u16s(t.ExpAvgSq[a:b]), u16s(vmax), s)
		}
	})
	t.Step++
	t.accumCount = 0
	t.accum = nil
	return nil
}

// parallel splits [0, n) into contiguous chunks, one per worker, aligned to
// 64 elements, and waits for all.
func (e *Engine) parallel(n int, fn func(lo, hi int)) {
	w := e.Workers
	if w < 1 {
		w = 1
	}
	minChunk := e.MinChunk
	if minChunk < 1 {
		minChunk = 1
	}
	if max := (n + minChunk - 1) / minChunk; w > max {
		w = max
	}
	if w <= 1 {
		fn(0, n)
		return
	}
	chunk := (n + w - 1) / w
	chunk = (chunk + 63) &^ 63
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += chunk {
		hi := lo + chunk
		if hi > n {
			hi = n
		}
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			fn(lo, hi)
		}(lo, hi)
	}
	wg.Wait()
}

// f32s views b as float32s (b must be 4-byte aligned; all engine and shared
// memory buffers are).
func f32s(b []byte) []float32 {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
}

// u16s views b as uint16s.
func u16s(b []byte) []uint16 {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2)
}

// F32s and U16s expose the views to other packages (tests, the Go trainer).
func F32s(b []byte) []float32 { return f32s(b) }

// U16s views b as uint16s (bfloat16 bit patterns).
func U16s(b []byte) []uint16 { return u16s(b) }

// ImportState replaces the tensor's state (as exported by torch's AdamW
// state_dict: step, exp_avg, exp_avg_sq and max_exp_avg_sq with amsgrad).
func (t *Tensor) ImportState(step int64, expAvg, expAvgSq, maxSq []byte) error {
	nb := t.Bytes()
	if step < 0 {
		return fmt.Errorf("tensor %q: negative step %d", t.Name, step)
	}
	if len(expAvg) != nb || len(expAvgSq) != nb {
		return fmt.Errorf("tensor %q: state is %d/%d bytes, want %d", t.Name, len(expAvg), len(expAvgSq), nb)
	}
	if t.Hyper.Amsgrad && len(maxSq) != nb {
		return fmt.Errorf("tensor %q: max_exp_avg_sq is %d bytes, want %d", t.Name, len(maxSq), nb)
	}
	copy(t.ExpAvg, expAvg)
	copy(t.ExpAvgSq, expAvgSq)
	if t.Hyper.Amsgrad {
		copy(t.MaxExpAvgSq, maxSq)
	}
	t.Step = step
	return nil
}
