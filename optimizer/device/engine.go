package device

import (
	"errors"
	"fmt"
	"math"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
)

// Engine applies AdamW to tensors on one device.
type Engine struct {
	Dev     *cuda.Device
	Kernels *Kernels
	Stream  *cuda.Stream
	done    *cuda.Event // the engine's completion event
}

// NewEngine loads the kernels on dv (compiled by nv, with the given loads)
// and creates the engine's stream.
func NewEngine(dv *cuda.Device, nv *cuda.NVRTC, loads Loads) (*Engine, error) {
	k, err := LoadKernels(dv, nv, loads)
	if err != nil {
		return nil, err
	}
	e, err := NewEngineWith(dv, k)
	if err != nil {
		_ = k.Close()
		return nil, err
	}
	return e, nil
}

// NewEngineWith creates an engine over kernels already loaded on dv.
func NewEngineWith(dv *cuda.Device, k *Kernels) (*Engine, error) {
	s, err := dv.NewStream()
	if err != nil {
		return nil, fmt.Errorf("creating the update stream: %w", err)
	}
	ev, err := dv.NewEvent(cuda.EventSync)
	if err != nil {
		_ = s.Destroy()
		return nil, fmt.Errorf("creating the completion event: %w", err)
	}
	return &Engine{Dev: dv, Kernels: k, Stream: s, done: ev}, nil
}

// Describe names the device and the kernels' build, e.g.
// "NVIDIA H200, cc 9.0, compute_90, scalar loads".
func (e *Engine) Describe() string {
	return fmt.Sprintf("%s, cc %d.%d, compute_%d, %s loads", e.Dev.Name, e.Dev.Major, e.Dev.Minor, e.Kernels.Arch, e.Kernels.Loads)
}

// Close destroys the engine's event and stream and unloads the kernels
// (after every tensor was freed); the device stays open.
func (e *Engine) Close() error {
	return errors.Join(e.done.Destroy(), e.Stream.Destroy(), e.Kernels.Close())
}

// Tensor is one parameter in device memory the engine does not own, and its
// optimizer state, which it does.
type Tensor struct {
	Name  string
	DType optimizer.DType
	Numel int64
	Hyper optimizer.Hyper
	Param cuda.DevicePtr

	Step   int64
	m, v   cuda.DevicePtr
	vmax   cuda.DevicePtr // amsgrad only
	accum  cuda.DevicePtr // 0 until the first accumulated micro-batch
	accumN int
}

// Bytes is the size of the parameter (and of each state buffer).
func (t *Tensor) Bytes() int64 { return t.Numel * int64(t.DType.Size()) }

// Pending is the number of accumulated micro-batch gradients not yet applied.
func (t *Tensor) Pending() int { return t.accumN }

// StateBytes is the device memory the engine holds for t.
func (t *Tensor) StateBytes() int64 {
	var n int64
	for _, p := range []cuda.DevicePtr{t.m, t.v, t.vmax, t.accum} {
		if p != 0 {
			n += t.Bytes()
		}
	}
	return n
}

// NewTensor allocates and zeroes the state of a parameter of numel elements
// of dtype dt at param.
func (e *Engine) NewTensor(name string, dt optimizer.DType, numel int64, h optimizer.Hyper, param cuda.DevicePtr) (*Tensor, error) {
	if dt != optimizer.Float32 && dt != optimizer.BFloat16 {
		return nil, fmt.Errorf("tensor %q: dtype %v not supported on CUDA", name, dt)
	}
	if err := h.Validate(); err != nil {
		return nil, fmt.Errorf("tensor %q: %w", name, err)
	}
	if numel <= 0 || param == 0 {
		return nil, fmt.Errorf("tensor %q: %d elements at %#x", name, numel, uint64(param))
	}
	t := &Tensor{Name: name, DType: dt, Numel: numel, Hyper: h, Param: param}
	bufs := []*cuda.DevicePtr{&t.m, &t.v}
	if h.Amsgrad {
		bufs = append(bufs, &t.vmax)
	}
	for _, b := range bufs {
		p, err := e.Dev.Alloc(t.Bytes())
		if err == nil {
			*b = p
			err = e.Stream.Zero(p, t.Bytes())
		}
		if err != nil {
			e.Free(t)
			return nil, fmt.Errorf("tensor %q: device state: %w", name, err)
		}
	}
	if err := e.finish(); err != nil {
		e.Free(t)
		return nil, fmt.Errorf("tensor %q: zeroing device state: %w", name, err)
	}
	return t, nil
}

// Free releases t's device state; no queued kernel may still use it (every
// Step waits for its own).
func (e *Engine) Free(t *Tensor) error {
	var errs []error
	for _, b := range []*cuda.DevicePtr{&t.m, &t.v, &t.vmax, &t.accum} {
		if *b != 0 {
			errs = append(errs, e.Dev.Free(*b))
			*b = 0
		}
	}
	return errors.Join(errs...)
}

// Item is one tensor of a Step: apply AdamW (Apply) or add one micro-batch
// gradient to the accumulation (not Apply). Grad 0 applies what was
// accumulated.
type Item struct {
	T       *Tensor
	Grad    cuda.DevicePtr
	Apply   bool
	Scalars optimizer.Scalars
}

// Step queues every item (the accumulations first, then the updates, one
// multi-tensor launch per dtype and batch) after wait (a client's event; nil:
// none) and returns when the device has finished them. The step counters
// advance only when everything succeeded; after a device error the tensors
// of this call may be partly updated, which the error says.
func (e *Engine) Step(wait *cuda.Event, items []Item) error {
	for i, it := range items {
		if it.Grad == 0 && it.T.accumN == 0 {
			return fmt.Errorf("tensor %s: nothing accumulated to apply", it.T.Name)
		}
		if it.Apply && it.Scalars.Amsgrad != it.T.Hyper.Amsgrad {
			return fmt.Errorf("tensor %s: amsgrad=%v in step but registered with amsgrad=%v", it.T.Name, it.Scalars.Amsgrad, it.T.Hyper.Amsgrad)
		}
		if it.Apply && it.Scalars.Fused && !fusedInputsGiven(it.Scalars) {
			return fmt.Errorf("tensor %s: fused AdamW on CUDA needs the step's lr, beta1 and weight_decay, "+
				"consistent with its decay and beta1_w scalars", it.T.Name)
		}
		for _, o := range items[:i] {
			if o.T == it.T {
				return fmt.Errorf("tensor %s appears twice in one step", it.T.Name)
			}
		}
	}
	// Accumulation buffers are allocated before anything is queued: a
	// failure here changes no parameter or state.
	for _, it := range items {
		if it.Grad != 0 && (!it.Apply || it.T.accumN > 0) && it.T.accum == 0 {
			p, err := e.Dev.Alloc(it.T.Bytes())
			if err != nil {
				return fmt.Errorf("tensor %s: accumulation buffer: %w", it.T.Name, err)
			}
			it.T.accum = p
		}
	}
	qerr := e.queue(wait, items)
	// Whatever was queued finishes before the reply (the client reuses the
	// gradients then), also after an error.
	if err := errors.Join(qerr, e.finish()); err != nil {
		return fmt.Errorf("CUDA step failed (the tensors of this request may be partly updated): %w", err)
	}
	for _, it := range items {
		if it.Apply {
			it.T.Step++
			it.T.accumN = 0
			if it.T.accum != 0 {
				_ = e.Dev.Free(it.T.accum) // as the CPU engine drops its buffer
				it.T.accum = 0
			}
		} else {
			it.T.accumN++
		}
	}
	return nil
}

// Discard drops t's accumulated gradients not yet applied (accumN, and the
// accumulation buffer, freed as an apply frees it), as torch's zero_grad
// drops .grad; the parameter, state and step count stay as they are. It
// reports whether anything was pending. No kernel may still use the buffer:
// every Step waits for its own. A buffer a failed Step left behind with
// nothing counted in it is freed too.
func (e *Engine) Discard(t *Tensor) bool {
	had := t.accumN > 0
	t.accumN = 0
	if t.accum != 0 {
		_ = e.Dev.Free(t.accum) // as Step frees it after an apply
		t.accum = 0
	}
	return had
}

func (e *Engine) queue(wait *cuda.Event, items []Item) error {
	if wait != nil {
		if err := e.Stream.WaitEvent(wait); err != nil {
			return err
		}
	}
	adds := map[optimizer.DType][]AddItem{}
	// One launch list per dtype and arithmetic (foreach, fused, fused double).
	type kind struct {
		dt optimizer.DType
		k  int
	}
	apply := map[kind][]Launch{}
	for _, it := range items {
		t := it.T
		src := it.Grad
		switch {
		case it.Grad != 0 && (!it.Apply || t.accumN > 0):
			if t.accumN == 0 {
				if err := e.Stream.CopyDtoD(t.accum, it.Grad, t.Bytes()); err != nil {
					return err
				}
			} else {
				adds[t.DType] = append(adds[t.DType], AddItem{Dst: t.accum, Src: it.Grad, Numel: t.Numel})
			}
			src = t.accum
		case it.Grad == 0:
			src = t.accum
		}
		if it.Apply {
			k := kind{t.DType, batchKind(it.Scalars)}
			apply[k] = append(apply[k], Launch{Param: t.Param, Grad: src, ExpAvg: t.m, ExpAvgSq: t.v,
				MaxExpAvgSq: t.vmax, Numel: t.Numel, Scalars: it.Scalars, Step: t.Step + 1})
		}
	}
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		if len(adds[dt]) > 0 {
			if err := e.Kernels.Accumulate(e.Stream, dt, adds[dt]); err != nil {
				return err
			}
		}
	}
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		for k := 0; k < 3; k++ {
			if l := apply[kind{dt, k}]; len(l) > 0 {
				if err := e.Kernels.AdamW(e.Stream, dt, l); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// Export copies t's state to dst (exp_avg, exp_avg_sq and, with amsgrad,
// max_exp_avg_sq: device addresses of t.Bytes() each).
func (e *Engine) Export(t *Tensor, dst []cuda.DevicePtr) error {
	return e.transfer(t, dst, true)
}

// Import replaces t's state with src (as Export lays it out) and its step.
func (e *Engine) Import(t *Tensor, step int64, src []cuda.DevicePtr) error {
	if step < 0 {
		return fmt.Errorf("tensor %q: negative step %d", t.Name, step)
	}
	if err := e.transfer(t, src, false); err != nil {
		return err
	}
	t.Step = step
	return nil
}

func (e *Engine) transfer(t *Tensor, refs []cuda.DevicePtr, out bool) error {
	// Accumulated gradients are not state: a transfer leaves them pending (an
	// import sets the state their step starts from).
	state := []cuda.DevicePtr{t.m, t.v}
	if t.Hyper.Amsgrad {
		state = append(state, t.vmax)
	}
	if len(refs) != len(state) {
		return fmt.Errorf("tensor %s: %d state buffers given, %d needed", t.Name, len(refs), len(state))
	}
	var qerr error
	for i := range state {
		dst, src := state[i], refs[i]
		if out {
			dst, src = refs[i], state[i]
		}
		if qerr = e.Stream.CopyDtoD(dst, src, t.Bytes()); qerr != nil {
			break
		}
	}
	return errors.Join(qerr, e.finish())
}

// finish waits (the host thread sleeps) until the work queued on the stream
// so far has finished, without synchronizing the whole device.
func (e *Engine) finish() error {
	if err := e.done.Record(e.Stream); err != nil {
		return err
	}
	return e.done.Sync()
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// fusedInputsGiven says whether a fused step carries the hyper-parameters
// the fused kernels take (lr, beta1, weight_decay), finite and consistent
// with the float64 scalars the client computed from the same values
// (beta1_w = 1 - beta1, decay = 1 - lr*weight_decay): a client that sent
// only the CPU kernel's scalars is refused instead of stepping with zeros.
func fusedInputsGiven(sc optimizer.Scalars) bool {
	if !finite(sc.LR) || !finite(sc.Beta1) || !finite(sc.WeightDecay) {
		return false
	}
	return sc.Beta1W == 1-sc.Beta1 && sc.Decay == 1-float64(sc.LR*sc.WeightDecay)
}
