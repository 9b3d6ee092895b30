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
	"errors"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/sonar-moe/sonar/internal/clip"
	"github.com/sonar-moe/sonar/internal/fault"
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
	return 0, fmt.Errorf("unsupported dtype %s (want float32 or bfloat16)", clip.Quote(s))
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

	bufs     []buffer // the state buffers' memory (Free)
	accumBuf buffer
	// damage is set when a memory fault interrupted an update half way:
	// the parameter and state are partly updated and the tensor refuses
	// updates and exports until ImportState replaces its state (or, when
	// only the accumulated sum was spoiled, Discard drops it).
	damage error
}

// stateOffset is where (mod 4 KiB) the engine's buffers for a parameter
// start: at the parameter's own offset. A kernel loads an element's inputs
// before it stores its outputs, and a load waits when its address matches,
// in the low 12 bits, a store still in the CPU's store buffer (4K
// aliasing): one issued up to about 2 KiB of the same streams earlier.
// Buffers that are read and written (the parameter, exp_avg, exp_avg_sq,
// max_exp_avg_sq and the accumulated gradient) are best at the same offset:
// every earlier store is then a whole page behind. Staggering them by
// 1-2.5 KiB, as the engine did before, made the bfloat16 single-tensor
// kernel 1.6x slower at 16M elements on an Intel Xeon (one core, 1.96
// against 1.19 ns an element, 2026-12-02).
// A gradient, only read, is best at the parameter's offset or up to 1 KiB
// after it (sonar_moe's gradient ring puts it 512 bytes after a
// page-aligned parameter).
func stateOffset(param []byte) int {
	if len(param) == 0 {
		return 0
	}
	return int(uintptr(unsafe.Pointer(&param[0])) % 4096)
}

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
	t := &Tensor{Name: name, DType: d, Numel: numel, Hyper: h, Param: param}
	bufs, off := 2, stateOffset(param)
	if h.Amsgrad {
		bufs = 3
	}
	for range bufs {
		b, err := allocStaggered(nb, off)
		if err != nil {
			t.Free()
			return nil, fmt.Errorf("tensor %q: optimizer state: %w", name, err)
		}
		t.bufs = append(t.bufs, b)
	}
	t.ExpAvg, t.ExpAvgSq = t.bufs[0].b, t.bufs[1].b
	if h.Amsgrad {
		t.MaxExpAvgSq = t.bufs[2].b
	}
	return t, nil
}

// StateBytesFor is the memory NewTensor allocates for a tensor of numel
// elements of d (exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq);
// the accumulation buffer, allocated while gradients are accumulated, is
// one more numel*d.Size().
func StateBytesFor(d DType, numel int64, amsgrad bool) int64 {
	n := int64(2)
	if amsgrad {
		n = 3
	}
	return n * numel * int64(d.Size())
}

// Free releases the tensor's state memory (mapped buffers go back to the
// kernel at once); the tensor must not be used after.
func (t *Tensor) Free() {
	for i := range t.bufs {
		t.bufs[i].free()
	}
	t.bufs = nil
	t.accumBuf.free()
	t.ExpAvg, t.ExpAvgSq, t.MaxExpAvgSq, t.accum, t.accumCount = nil, nil, nil, nil, 0
}

// Damage is nil for an intact tensor, else why its parameter and state may
// be partly updated (a memory fault interrupted an update).
func (t *Tensor) Damage() error { return t.damage }

// FaultError is a memory fault that interrupted an update of a tensor.
type FaultError struct {
	Tensor string
	// Op is what was running ("apply", "accumulate", "import").
	Op string
	// Partial says the parameter, state or accumulated gradient may be
	// partly updated (the tensor is marked damaged); false: nothing changed.
	Partial bool
	Fault   *fault.Error
}

func (e *FaultError) Error() string {
	what := "nothing of it changed"
	if e.Op == "export" {
		what = "its state is intact, the destination memory is incomplete"
	}
	if e.Partial {
		what = "its parameter and optimizer state may be partly updated: the tensor refuses updates and exports until its state is imported again (load_state_dict)"
		if e.Op == "accumulate" {
			what = "its accumulated gradient is partly summed and was dropped (parameter and state intact): the tensor refuses updates and exports " +
				"until its pending gradients are discarded (zero_grad) or its state is imported again (load_state_dict)"
		}
	}
	return fmt.Sprintf("tensor %q: %s interrupted by a %v; %s", e.Tensor, e.Op, e.Fault, what)
}

func (e *FaultError) Unwrap() error { return e.Fault }

func (t *Tensor) usable() error {
	if t.damage != nil {
		return fmt.Errorf("tensor %q is damaged: %w", t.Name, t.damage)
	}
	if t.ExpAvg == nil {
		return fmt.Errorf("tensor %q was freed", t.Name)
	}
	return nil
}

// faulted turns an error of parallel into a FaultError, marking the tensor
// damaged when the update may be partial.
func (t *Tensor) faulted(op string, partial bool, err error) error {
	var fe *fault.Error
	if !errors.As(err, &fe) {
		return err
	}
	e := &FaultError{Tensor: t.Name, Op: op, Partial: partial, Fault: fe}
	if partial {
		t.damage = e
		t.dropAccum() // a partial sum is worthless; without it the state can be imported again
	}
	return e
}

// Bytes is the size of the parameter (and of each state buffer) in bytes.
func (t *Tensor) Bytes() int { return t.Numel * t.DType.Size() }

// StateBytes is the memory the engine holds for this tensor.
func (t *Tensor) StateBytes() int {
	n := len(t.ExpAvg) + len(t.ExpAvgSq) + len(t.MaxExpAvgSq) + len(t.accum)
	return n
}

// AccumulationBytes is the memory the next Accumulate allocates (0 when
// its buffer exists).
func (t *Tensor) AccumulationBytes() int64 {
	if t.accumCount > 0 || t.accum != nil {
		return 0
	}
	return int64(t.Bytes())
}

// Pending reports how many accumulated micro-batch gradients wait to be applied.
func (t *Tensor) Pending() int { return t.accumCount }

// Engine applies AdamW steps using up to Workers goroutines per tensor.
type Engine struct {
	Workers int
	// MinChunk is the smallest number of elements worth a goroutine.
	MinChunk int
	// Sqrt is the float32 square root (the zero value: IEEE); see package vml.
	Sqrt Sqrt
	// SqrtName says which square root Sqrt is ("ieee" for the zero value).
	SqrtName string
	// Phases, when set, sums the time spent reading gradients and in the
	// arithmetic.
	Phases *Phases
	// ChunksPerWorker is how many chunks a tensor is cut into per worker
	// (0: chunksPerWorker; 1: one fixed chunk each, the engine before
	// 2026-12-01, kept for benchmarks).
	ChunksPerWorker int
	// CallerWaits makes the caller of a step only wait while Workers
	// goroutines take the chunks (the engine before 2026-12-02, kept for
	// benchmarks); by default the caller is one of the workers.
	CallerWaits bool
	// Spin is how long idle helpers poll for the next job and the caller for
	// the helpers' last chunks before blocking (0: helperSpin; negative:
	// never; helpers.go).
	Spin time.Duration
	// Steer keeps each helper off the CPU of the goroutine that started it
	// while it works (helpers.go): on virtual machines whose idle CPUs halt,
	// a helper woken after an idle gap otherwise shares its caller's core.
	Steer bool

	helpers helperPool // the goroutines beside the caller (helpers.go)
}

// NewEngine returns an engine using all cores.
func NewEngine() *Engine {
	return &Engine{Workers: runtime.GOMAXPROCS(0), MinChunk: 1 << 16, SqrtName: "ieee"}
}

// Accumulate adds one micro-batch gradient into the tensor's accumulation
// buffer (the first one is copied), as autograd accumulates into .grad.
func (e *Engine) Accumulate(t *Tensor, grad []byte) error {
	if err := t.usable(); err != nil {
		return err
	}
	if len(grad) != t.Bytes() {
		return fmt.Errorf("tensor %q: gradient is %d bytes, want %d", t.Name, len(grad), t.Bytes())
	}
	if t.accumCount == 0 {
		if err := t.ensureAccum(); err != nil {
			return err
		}
		err := e.parallel(t.Numel, func(lo, hi int) {
			sz := t.DType.Size()
			copy(t.accum[lo*sz:hi*sz], grad[lo*sz:hi*sz])
		})
		if err != nil { // the first copy: nothing was accumulated before, nothing is lost
			t.dropAccum()
			return t.faulted("accumulate", false, err)
		}
	} else {
		err := e.parallel(t.Numel, func(lo, hi int) {
			sz := t.DType.Size()
			t.addToAccum(lo, hi, grad[lo*sz:hi*sz])
		})
		if err != nil {
			return t.faulted("accumulate", true, err)
		}
	}
	t.accumCount++
	return nil
}

// ensureAccum allocates the accumulation buffer if the tensor has none.
func (t *Tensor) ensureAccum() error {
	if t.accum != nil {
		return nil
	}
	b, err := allocStaggered(t.Bytes(), stateOffset(t.Param))
	if err != nil {
		return fmt.Errorf("tensor %q: gradient accumulation buffer: %w", t.Name, err)
	}
	t.accumBuf, t.accum = b, b.b
	return nil
}

// addToAccum adds g, the gradient of elements [lo, hi), into the
// accumulation buffer in the tensor's dtype.
func (t *Tensor) addToAccum(lo, hi int, g []byte) {
	switch t.DType {
	case Float32:
		AddF32(f32s(t.accum)[lo:hi], f32s(g))
	case BFloat16:
		AddBF16(u16s(t.accum)[lo:hi], u16s(g))
	}
}

func (t *Tensor) dropAccum() {
	t.accumBuf.free()
	t.accum, t.accumCount = nil, 0
}

// Discard drops the gradients accumulated and not yet applied (the
// accumulation buffer, freed, and its count), as torch's zero_grad drops
// .grad; the parameter, the optimizer state and the step count stay as they
// are. A damage mark left by an interrupted accumulation is cleared too:
// such a fault spoiled the pending sum alone (it was dropped then; the
// parameter and state were not touched), and that sum is what is discarded.
// The mark of an interrupted apply or import stays: only ImportState
// replaces a state that may be partly updated. Discard reports whether
// anything was pending, a spoiled sum included.
func (t *Tensor) Discard() bool {
	had := t.accumCount > 0
	t.dropAccum()
	if t.damage != nil && sumDamage(t.damage) {
		t.damage = nil
		had = true
	}
	return had
}

// sumDamage reports whether a damage mark concerns the accumulated gradient
// alone: a fault or failed read while a micro-batch was added to the sum
// (Accumulate, AccumulateFrom, or the accumulation an apply starts with),
// which returns before the parameter or state is touched.
func sumDamage(err error) bool {
	var fe *FaultError
	if errors.As(err, &fe) {
		return fe.Op == "accumulate"
	}
	var re *ReadError
	if errors.As(err, &re) {
		return re.Op == "accumulate"
	}
	return false
}

// Apply performs one AdamW step. With grad == nil it applies the accumulated
// gradient; otherwise grad is first added to any accumulated gradient. The
// accumulation buffer is released afterwards.
func (e *Engine) Apply(t *Tensor, grad []byte, s Scalars) error {
	_, err := e.ApplyScaled(t, grad, s, GradPrep{})
	return err
}

// GradPrep asks ApplyScaled for work on the gradient before the AdamW
// arithmetic: the squared L2 norm of the gradient as it arrives (the sum of
// what was accumulated and grad), and a factor it is multiplied by (rounded
// as torch's grad.mul_(scale) with a float32 scale: float32(g*s), and for
// bfloat16 bf16(float32(g)*s)). Both happen in one pass over the gradient.
type GradPrep struct {
	// Scale multiplies the gradient; 0 and 1 leave it as it is.
	Scale float32
	// Norm asks for the squared L2 norm (summed in float64; the order of
	// the sum follows the engine's split across workers).
	Norm bool
}

// ApplyScaled is Apply with the gradient first measured and scaled as prep
// says (in place: the gradient's memory is overwritten with the scaled
// value). It returns the squared L2 norm of the gradient before scaling,
// 0 unless prep.Norm.
func (e *Engine) ApplyScaled(t *Tensor, grad []byte, s Scalars, prep GradPrep) (float64, error) {
	if err := t.usable(); err != nil {
		return 0, err
	}
	if grad != nil && len(grad) != t.Bytes() {
		return 0, fmt.Errorf("tensor %q: gradient is %d bytes, want %d", t.Name, len(grad), t.Bytes())
	}
	if s.Amsgrad != t.Hyper.Amsgrad {
		return 0, fmt.Errorf("tensor %q: amsgrad=%v in step but registered with amsgrad=%v", t.Name, s.Amsgrad, t.Hyper.Amsgrad)
	}
	if grad == nil && t.accumCount == 0 {
		return 0, fmt.Errorf("tensor %q: no gradient to apply", t.Name)
	}
	if grad != nil && t.accumCount > 0 {
		if err := e.Accumulate(t, grad); err != nil {
			return 0, err
		}
		grad = nil
	}
	if grad == nil {
		grad = t.accum
	}
	var sqnorm float64
	if prep.active() {
		var err error
		if sqnorm, err = e.prepare(t, grad, prep); err != nil {
			return 0, t.faulted("scale gradient", false, err)
		}
	}
	err := e.parallel(t.Numel, func(lo, hi int) {
		sz := t.DType.Size()
		e.kernel(t, grad[lo*sz:hi*sz], s, lo, hi)
	})
	if err != nil {
		return 0, t.faulted("apply", true, err)
	}
	t.Step++
	t.dropAccum()
	return sqnorm, nil
}

// prepare measures and scales grad (t's gradient) in one parallel pass.
func (e *Engine) prepare(t *Tensor, grad []byte, prep GradPrep) (float64, error) {
	var sums positionSums
	err := e.parallel(t.Numel, func(lo, hi int) {
		sz := t.DType.Size()
		sums.add(lo, scaleGrad(t.DType, grad[lo*sz:hi*sz], prep))
	})
	if err != nil {
		return 0, err
	}
	return sums.total(), nil
}

// scaleGrad measures and scales g as prep says (ScaleF32, ScaleBF16).
func scaleGrad(d DType, g []byte, prep GradPrep) float64 {
	scale := prep.Scale
	if scale == 0 {
		scale = 1
	}
	if d == Float32 {
		return ScaleF32(f32s(g), scale, prep.Norm)
	}
	return ScaleBF16(u16s(g), scale, prep.Norm)
}

// active says whether prep asks for any work on the gradient.
func (p GradPrep) active() bool { return p.Norm || (p.Scale != 0 && p.Scale != 1) }

// positionSums collects partial sums from several goroutines, each at the
// position of its part, and adds them in order of position, so the total
// does not depend on which goroutine finished first.
type positionSums struct {
	mu    sync.Mutex
	parts map[int]float64
}

func (p *positionSums) add(at int, sum float64) {
	p.mu.Lock()
	if p.parts == nil {
		p.parts = map[int]float64{}
	}
	p.parts[at] = sum
	p.mu.Unlock()
}

func (p *positionSums) total() float64 {
	var total float64
	for _, at := range slices.Sorted(maps.Keys(p.parts)) {
		total += p.parts[at]
	}
	return total
}

// kernel runs the AdamW arithmetic s selects over elements [lo, hi) of t,
// whose gradient is g (exactly those elements).
func (e *Engine) kernel(t *Tensor, g []byte, s Scalars, lo, hi int) {
	if e.Phases != nil {
		defer since(&e.Phases.kernelNanos, time.Now())
	}
	sz := t.DType.Size()
	a, b := lo*sz, hi*sz
	var vmax []byte
	if s.Amsgrad {
		vmax = t.MaxExpAvgSq[a:b]
	}
	switch {
	case s.Fused && t.DType == Float32:
		FusedStepF32(f32s(t.Param[a:b]), f32s(g), f32s(t.ExpAvg[a:b]), f32s(t.ExpAvgSq[a:b]), f32s(vmax), s, lo, t.Numel)
	case s.Fused:
		FusedStepBF16(u16s(t.Param[a:b]), u16s(g), u16s(t.ExpAvg[a:b]), u16s(t.ExpAvgSq[a:b]), u16s(vmax), s, lo, t.Numel)
	case t.DType == Float32:
		StepF32(f32s(t.Param[a:b]), f32s(g), f32s(t.ExpAvg[a:b]), f32s(t.ExpAvgSq[a:b]), f32s(vmax), s, e.Sqrt)
	default:
		StepBF16(u16s(t.Param[a:b]), u16s(g), u16s(t.ExpAvg[a:b]), u16s(t.ExpAvgSq[a:b]), u16s(vmax), s)
	}
}

// parallel runs fn over [0, n) in contiguous chunks aligned to 64 elements
// and waits for all. The caller and up to Workers-1 goroutines take the
// chunks in order from a shared counter, several each (chunksPerWorker), so
// a worker whose core is busy with another thread (torch's, another
// process's) takes fewer and the others take its share, instead of everyone
// waiting for the slowest fixed half. The chunks' bounds depend on n and
// Workers only, never on timing, so sums kept by position (positionSums) are
// the same whoever ran which chunk.
// Each chunk runs under fault.Catch (the memory may be a client's shared
// memory); the first fault is returned, after every chunk has finished.
func (e *Engine) parallel(n int, fn func(lo, hi int)) error {
	w, chunk := e.split(n)
	if w <= 1 {
		return fault.Catch(func() { fn(0, n) })
	}
	chunks := (n + chunk - 1) / chunk
	var next, done atomic.Int64
	finished := make(chan struct{}) // closed by whoever finishes the last chunk
	errs := make([]error, 0, w)
	var mu sync.Mutex
	work := func() {
		for {
			i := int(next.Add(1)) - 1
			if i >= chunks {
				return
			}
			lo := i * chunk
			hi := min(lo+chunk, n)
			if err := fault.Catch(func() { fn(lo, hi) }); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
			if done.Add(1) == int64(chunks) {
				close(finished)
			}
		}
	}
	// The caller is one of the workers and returns once every chunk is done,
	// not when the other goroutines have exited: one that starts late finds
	// no chunk left and ends without touching fn. On a virtual CPU that halts
	// when idle every thread wake-up costs tens of microseconds, and a caller
	// that only waited (sonard's goroutine is locked to the main thread,
	// which lends itself to no other goroutine) handed its P to another
	// thread and had to be woken again at the end: a float32 step on two
	// workers took 2.1x as long for 131K elements, 1.14x for 614K, the same
	// for 2M (BenchmarkParallelCaller, medians of 5, 2026-12-02).
	// The helpers are the engine's (helpers.go): ones still polling after the
	// previous job take this one at once; the missing ones are started.
	helpers := min(w, chunks) - 1
	if e.CallerWaits {
		for range helpers + 1 {
			go work()
		}
		<-finished
	} else {
		j := &job{work: work}
		e.helpers.publish(j, helpers, e.spin(), e.Steer)
		work()
		await(&done, int64(chunks), finished, e.spin())
		e.helpers.retire(j)
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// split says how many workers parallel uses for n elements and how long its
// chunks are (n when one worker does it all).
func (e *Engine) split(n int) (workers, chunk int) {
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
		return 1, n
	}
	per := e.ChunksPerWorker
	if per < 1 {
		per = chunksPerWorker
	}
	chunk = (n + w*per - 1) / (w * per)
	if per > 1 {
		chunk = max(chunk, minDynamicChunk)
	}
	return w, (chunk + 63) &^ 63
}

// chunksPerWorker is how many chunks parallel cuts per worker: enough that a
// worker slowed to half speed costs the step a sixteenth of its time, not
// half; minDynamicChunk keeps each chunk long enough (64 KiB of float32) that
// taking one costs nothing next to its arithmetic.
const (
	chunksPerWorker = 8
	minDynamicChunk = 16384
)

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
// state_dict: step, exp_avg, exp_avg_sq and max_exp_avg_sq with amsgrad),
// and clears a damage mark. The sources may be a client's shared memory: a
// fault while copying leaves the tensor damaged.
func (t *Tensor) ImportState(step int64, expAvg, expAvgSq, maxSq []byte) error {
	nb := t.Bytes()
	if t.ExpAvg == nil {
		return fmt.Errorf("tensor %q was freed", t.Name)
	}
	if step < 0 {
		return fmt.Errorf("tensor %q: negative step %d", t.Name, step)
	}
	if len(expAvg) != nb || len(expAvgSq) != nb {
		return fmt.Errorf("tensor %q: state is %d/%d bytes, want %d", t.Name, len(expAvg), len(expAvgSq), nb)
	}
	if t.Hyper.Amsgrad && len(maxSq) != nb {
		return fmt.Errorf("tensor %q: max_exp_avg_sq is %d bytes, want %d", t.Name, len(maxSq), nb)
	}
	err := fault.Catch(func() {
		copy(t.ExpAvg, expAvg)
		copy(t.ExpAvgSq, expAvgSq)
		if t.Hyper.Amsgrad {
			copy(t.MaxExpAvgSq, maxSq)
		}
	})
	if err != nil {
		return t.faulted("import", true, err)
	}
	t.Step = step
	t.damage = nil
	return nil
}

// ExportState copies the tensor's state into the destinations (a client's
// shared memory: a fault is returned and the tensor stays intact).
func (t *Tensor) ExportState(expAvg, expAvgSq, maxSq []byte) error {
	if err := t.usable(); err != nil {
		return err
	}
	err := fault.Catch(func() {
		copy(expAvg, t.ExpAvg)
		copy(expAvgSq, t.ExpAvgSq)
		if t.Hyper.Amsgrad {
			copy(maxSq, t.MaxExpAvgSq)
		}
	})
	return t.faulted("export", false, err)
}
