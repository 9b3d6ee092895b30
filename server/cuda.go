package server

// The CUDA path: expert tensors that stay in the client's GPU memory, named
// by CUDA IPC handles (attach_cuda), updated in place by the AdamW kernels of
// package cuda on the server's stream, with the optimizer state in device
// memory of the server. It is optional: without EnableCUDA the server answers
// attach_cuda and cuda_event with an error and everything else is the CPU
// path, unchanged. docs/gpu.md describes the design.

import (
	"errors"
	"fmt"
	"time"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"go.uber.org/zap"
)

// GPU is the server's CUDA device: the kernels loaded on it, the stream the
// updates run on, and the mapper that opens client allocations. Cache is
// optional (its counters go into stats).
type GPU struct {
	Dev     *cuda.Device
	Kernels *cuda.Kernels
	Stream  *cuda.Stream
	Mapper  ipcbridge.DeviceMapper
	Cache   *cuda.IPCCache
}

// EnableCUDA turns the CUDA path on. Call it after New, before serving.
func (s *Server) EnableCUDA(g *GPU) { s.gpu = g }

// errNoCUDA answers CUDA requests of a server without a GPU.
var errNoCUDA = errors.New("this sonard has no CUDA path (no driver or device, or started with --cuda-device -1): use CPU expert tensors")

// cudaName is hello's description of the GPU, "" without one.
func (s *Server) cudaName() string {
	if s.gpu == nil {
		return ""
	}
	return fmt.Sprintf("%s, cc %d.%d, compute_%d", s.gpu.Dev.Name, s.gpu.Dev.Major, s.gpu.Dev.Minor, s.gpu.Kernels.Arch)
}

// gpuTensor is a registered tensor whose parameter is client GPU memory; its
// state (and the accumulation buffer, allocated on first use) is device
// memory of the server.
type gpuTensor struct {
	id     uint32
	name   string
	dtype  optimizer.DType
	numel  int64
	shape  []int64
	hyper  optimizer.Hyper
	seg    uint32
	step   int64
	param  cuda.DevicePtr
	m, v   cuda.DevicePtr
	vmax   cuda.DevicePtr // amsgrad only
	accum  cuda.DevicePtr // 0 until the first accumulated micro-batch
	accumN int
}

func (t *gpuTensor) bytes() int64 { return t.numel * int64(t.dtype.Size()) }

func (t *gpuTensor) stateBytes() int64 {
	n := 2 * t.bytes()
	if t.vmax != 0 {
		n += t.bytes()
	}
	if t.accum != 0 {
		n += t.bytes()
	}
	return n
}

func (s *Server) attachCUDA(ss *session, a ipc.AttachCUDA) (any, error) {
	if s.gpu == nil {
		return nil, errNoCUDA
	}
	dm, err := s.gpu.Mapper.MapDevice(a.Handle, a.Size)
	if err != nil {
		return nil, fmt.Errorf("attach_cuda: %w", err)
	}
	s.nextID++
	id := s.nextID
	ss.dsegments[id] = dm
	s.log.Debug("CUDA allocation attached", zap.String("client", ss.client), zap.String("name", dm.Name()),
		zap.Int64("size", dm.Size()), zap.Uint32("seg", id))
	return ipc.AttachReply{Seg: id}, nil
}

func (s *Server) cudaEvent(ss *session, e ipc.CUDAEvent) (any, error) {
	if s.gpu == nil {
		return nil, errNoCUDA
	}
	var h cuda.IPCEventHandle
	copy(h.Reserved[:], e.Handle)
	ev, err := s.gpu.Dev.OpenIPCEvent(h)
	if err != nil {
		return nil, fmt.Errorf("cuda_event: %w", err)
	}
	if ss.event != nil {
		if err := ss.event.Destroy(); err != nil {
			s.log.Warn("destroying the previous client event", zap.String("client", ss.client), zap.Error(err))
		}
	}
	ss.event = ev
	return map[string]bool{"event": true}, nil
}

// devicePtr resolves a MemRef of the session to a device address.
func (ss *session) devicePtr(ref ipc.MemRef, want, align int64) (cuda.DevicePtr, error) {
	dm := ss.dsegments[ref.Seg]
	if dm == nil {
		if ss.segments[ref.Seg] != nil {
			return 0, fmt.Errorf("segment %d is shared memory, the tensor is CUDA memory", ref.Seg)
		}
		return 0, fmt.Errorf("unknown segment %d", ref.Seg)
	}
	if ref.Bytes != want {
		return 0, fmt.Errorf("reference is %d bytes, tensor needs %d", ref.Bytes, want)
	}
	return dm.Ptr(ref.Offset, ref.Bytes, align)
}

func overlapsDev(a, b cuda.DevicePtr, n int64) bool {
	return a < b+cuda.DevicePtr(n) && b < a+cuda.DevicePtr(n)
}

// prepareCUDATensor validates one spec whose parameter is in a device
// segment; the state is allocated by allocCUDATensors.
func (s *Server) prepareCUDATensor(ss *session, spec ipc.TensorSpec, d optimizer.DType) (*gpuTensor, error) {
	if d != optimizer.Float32 && d != optimizer.BFloat16 {
		return nil, fmt.Errorf("tensor %q: dtype %v not supported on CUDA", spec.Name, d)
	}
	h := optimizer.Hyper{LR: spec.Hyper.LR, Beta1: spec.Hyper.Beta1, Beta2: spec.Hyper.Beta2, Eps: spec.Hyper.Eps,
		WeightDecay: spec.Hyper.WeightDecay, Amsgrad: spec.Hyper.Amsgrad, Maximize: spec.Hyper.Maximize}
	if err := h.Validate(); err != nil {
		return nil, fmt.Errorf("tensor %q: %w", spec.Name, err)
	}
	t := &gpuTensor{name: spec.Name, dtype: d, numel: spec.Numel(), shape: spec.Shape, hyper: h, seg: spec.Param.Seg}
	p, err := ss.devicePtr(spec.Param, t.bytes(), int64(d.Size()))
	if err != nil {
		return nil, fmt.Errorf("tensor %q param: %w", spec.Name, err)
	}
	t.param = p
	return t, nil
}

// allocCUDATensors allocates and zeroes the state of validated tensors; on
// failure it frees what it allocated.
func (s *Server) allocCUDATensors(ts []*gpuTensor) error {
	var done []*gpuTensor
	for _, t := range ts {
		if err := s.allocState(t); err != nil {
			for _, d := range done {
				s.freeCUDATensor(d)
			}
			return fmt.Errorf("tensor %q: device state: %w", t.name, err)
		}
		done = append(done, t)
	}
	return nil
}

func (s *Server) allocState(t *gpuTensor) error {
	g := s.gpu
	bufs := []*cuda.DevicePtr{&t.m, &t.v}
	if t.hyper.Amsgrad {
		bufs = append(bufs, &t.vmax)
	}
	for _, b := range bufs {
		p, err := g.Dev.Alloc(t.bytes())
		if err != nil {
			s.freeCUDATensor(t)
			return err
		}
		*b = p
		if err := g.Stream.Zero(p, t.bytes()); err != nil {
			s.freeCUDATensor(t)
			return err
		}
	}
	return nil
}

// freeCUDATensor frees a tensor's device memory (no kernel may still use it).
func (s *Server) freeCUDATensor(t *gpuTensor) {
	for _, b := range []*cuda.DevicePtr{&t.m, &t.v, &t.vmax, &t.accum} {
		if *b != 0 {
			if err := s.gpu.Dev.Free(*b); err != nil {
				s.log.Warn("freeing device state", zap.String("tensor", t.name), zap.Error(err))
			}
			*b = 0
		}
	}
}

// finish waits (the host thread sleeps) until the work queued on the stream
// so far has finished, without synchronizing the device.
func (s *Server) finish() error {
	g := s.gpu
	if s.gpuDone == nil {
		ev, err := g.Dev.NewEvent(cuda.EventSync)
		if err != nil {
			return err
		}
		s.gpuDone = ev
	}
	if err := s.gpuDone.Record(g.Stream); err != nil {
		return err
	}
	return s.gpuDone.Sync()
}

func scalarsOf(sc ipc.ScalarsMsg) optimizer.Scalars {
	return optimizer.Scalars{Decay: sc.Decay, ApplyDecay: sc.ApplyDecay, Beta1W: sc.Beta1W, Beta2: sc.Beta2,
		OneMinusB2: sc.OneMinusB2, NegStepSize: sc.NegStepSize, BC2Sqrt: sc.BC2Sqrt, Eps: sc.Eps,
		Amsgrad: sc.Amsgrad, Maximize: sc.Maximize}
}

type gpuWork struct {
	t    *gpuTensor
	grad cuda.DevicePtr
	it   ipc.StepItem
}

// stepCUDA is step for CUDA tensors: a request is all CUDA or all CPU.
func (s *Server) stepCUDA(ss *session, st ipc.Step) (any, error) {
	start := time.Now()
	work := make([]gpuWork, 0, len(st.Items))
	for i, it := range st.Items {
		t := ss.dtensors[it.Tensor]
		if t == nil {
			if ss.tensors[it.Tensor] != nil {
				return nil, fmt.Errorf("item %d: tensor %d is a CPU tensor: one step request holds CPU or CUDA tensors, not both", i, it.Tensor)
			}
			return nil, fmt.Errorf("item %d: unknown tensor %d", i, it.Tensor)
		}
		var grad cuda.DevicePtr
		if it.Grad.Seg != 0 {
			g, err := ss.devicePtr(it.Grad, t.bytes(), int64(t.dtype.Size()))
			if err != nil {
				return nil, fmt.Errorf("item %d (%s) grad: %w", i, t.name, err)
			}
			if overlapsDev(g, t.param, t.bytes()) {
				return nil, fmt.Errorf("item %d (%s): gradient memory overlaps the parameter", i, t.name)
			}
			grad = g
		} else if t.accumN == 0 {
			return nil, fmt.Errorf("item %d (%s): nothing accumulated to apply", i, t.name)
		}
		if it.Apply {
			if it.Scalars.Amsgrad != t.hyper.Amsgrad || it.Scalars.Maximize != t.hyper.Maximize {
				return nil, fmt.Errorf("item %d (%s): amsgrad/maximize differ from registration", i, t.name)
			}
			if it.Step != t.step+1 {
				return nil, fmt.Errorf("item %d (%s): client step %d but server is at step %d", i, t.name, it.Step, t.step)
			}
		}
		work = append(work, gpuWork{t: t, grad: grad, it: it})
	}
	if st.WaitEvent && ss.event == nil {
		return nil, errors.New("wait_event set but the session sent no cuda_event")
	}
	// Accumulation buffers are allocated before anything is queued: a
	// failure here changes no parameter or state.
	for _, w := range work {
		if w.grad != 0 && (!w.it.Apply || w.t.accumN > 0) && w.t.accum == 0 {
			p, err := s.gpu.Dev.Alloc(w.t.bytes())
			if err != nil {
				return nil, fmt.Errorf("tensor %s: accumulation buffer: %w", w.t.name, err)
			}
			w.t.accum = p
		}
	}
	rep, qerr := s.queueCUDA(ss, st.WaitEvent, work)
	// Whatever was queued must finish before the reply (the client reuses
	// the gradients then) — also after an error.
	ferr := s.finish()
	if err := errors.Join(qerr, ferr); err != nil {
		return nil, fmt.Errorf("CUDA step failed (the tensors of this request may be partly updated): %w", err)
	}
	for _, w := range work {
		if w.it.Apply {
			w.t.step++
			w.t.accumN = 0
		} else {
			w.t.accumN++
		}
	}
	rep.Micros = time.Since(start).Microseconds()
	s.stepItems += int64(len(work))
	s.bytesUpdated += rep.Bytes
	s.recordLatency(rep.Micros)
	return rep, nil
}

func (s *Server) queueCUDA(ss *session, wait bool, work []gpuWork) (ipc.StepReply, error) {
	var rep ipc.StepReply
	g := s.gpu
	if wait {
		if err := g.Stream.WaitEvent(ss.event); err != nil {
			return rep, err
		}
	}
	adds := map[optimizer.DType][]cuda.AddItem{}
	apply := map[optimizer.DType][]cuda.Tensor{}
	for _, w := range work {
		t := w.t
		src := w.grad
		if w.grad != 0 && (!w.it.Apply || t.accumN > 0) {
			if t.accumN == 0 {
				if err := g.Stream.CopyDtoD(t.accum, w.grad, t.bytes()); err != nil {
					return rep, err
				}
			} else {
				adds[t.dtype] = append(adds[t.dtype], cuda.AddItem{Dst: t.accum, Src: w.grad, Numel: t.numel})
			}
			src = t.accum
		} else if w.grad == 0 {
			src = t.accum
		}
		if w.it.Apply {
			apply[t.dtype] = append(apply[t.dtype], cuda.Tensor{Param: t.param, Grad: src, ExpAvg: t.m, ExpAvgSq: t.v,
				MaxExpAvgSq: t.vmax, Numel: t.numel, Scalars: scalarsOf(w.it.Scalars)})
			rep.Applied++
		} else {
			rep.Accumulated++
		}
		rep.Bytes += t.bytes()
	}
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		if len(adds[dt]) > 0 {
			if err := g.Kernels.Accumulate(g.Stream, dt, adds[dt]); err != nil {
				return rep, err
			}
		}
	}
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		if len(apply[dt]) > 0 {
			if err := g.Kernels.AdamW(g.Stream, dt, apply[dt]); err != nil {
				return rep, err
			}
		}
	}
	return rep, nil
}

// xferCUDA is export (toClient) or import of a CUDA tensor's state through
// device references of the session.
func (s *Server) xferCUDA(ss *session, t *gpuTensor, x ipc.StateXfer, toClient bool) (any, error) {
	if t.accumN > 0 {
		return nil, fmt.Errorf("tensor %s has %d accumulated gradients not yet applied", t.name, t.accumN)
	}
	if !toClient && x.Step < 0 {
		return nil, fmt.Errorf("tensor %q: negative step %d", t.name, x.Step)
	}
	refs := []ipc.MemRef{x.ExpAvg, x.ExpAvgSq}
	state := []cuda.DevicePtr{t.m, t.v}
	if t.hyper.Amsgrad {
		refs = append(refs, x.MaxExpAvgSq)
		state = append(state, t.vmax)
	}
	ptrs := make([]cuda.DevicePtr, len(refs))
	for i, r := range refs {
		p, err := ss.devicePtr(r, t.bytes(), int64(t.dtype.Size()))
		if err != nil {
			return nil, fmt.Errorf("tensor %s state part %d: %w", t.name, i, err)
		}
		if overlapsDev(p, t.param, t.bytes()) {
			return nil, fmt.Errorf("tensor %s state part %d overlaps the parameter", t.name, i)
		}
		for j := 0; j < i; j++ {
			if overlapsDev(p, ptrs[j], t.bytes()) {
				return nil, fmt.Errorf("tensor %s state parts %d and %d overlap", t.name, j, i)
			}
		}
		ptrs[i] = p
	}
	var qerr error
	for i := range ptrs {
		dst, src := state[i], ptrs[i]
		if toClient {
			dst, src = ptrs[i], state[i]
		}
		if qerr = s.gpu.Stream.CopyDtoD(dst, src, t.bytes()); qerr != nil {
			break
		}
	}
	if err := errors.Join(qerr, s.finish()); err != nil {
		return nil, err
	}
	if !toClient {
		t.step = x.Step
	}
	return ipc.ExportReply{Step: t.step, Amsgrad: t.hyper.Amsgrad}, nil
}

// releaseCUDA frees a session's device state, closes its CUDA allocations
// and its event. Every request waited for its kernels, so none is running.
func (s *Server) releaseCUDA(ss *session) []error {
	var errs []error
	if s.gpu != nil {
		for _, t := range ss.dtensors {
			s.freeCUDATensor(t)
		}
	}
	for _, dm := range ss.dsegments {
		errs = append(errs, dm.Close())
	}
	if ss.event != nil {
		errs = append(errs, ss.event.Destroy())
		ss.event = nil
	}
	return errs
}

// detachCUDA detaches a device segment (ok false: not one).
func (s *Server) detachCUDA(ss *session, seg uint32) (bool, error) {
	dm := ss.dsegments[seg]
	if dm == nil {
		return false, nil
	}
	for _, t := range ss.dtensors {
		if t.seg == seg {
			return true, fmt.Errorf("segment %d holds tensor %s: cannot detach", seg, t.name)
		}
	}
	delete(ss.dsegments, seg)
	return true, dm.Close()
}

// cudaStats adds the CUDA path's counters.
func (s *Server) cudaStats(st *ipc.Stats) {
	for _, ss := range s.sessions {
		st.DeviceSegments += len(ss.dsegments)
		st.Tensors += len(ss.dtensors)
		for _, t := range ss.dtensors {
			st.DeviceStateBytes += t.stateBytes()
		}
	}
	if s.gpu != nil && s.gpu.Cache != nil {
		cs := s.gpu.Cache.Stats()
		st.IPCOpen, st.IPCOpenBytes, st.IPCOpens = cs.Open, cs.Bytes, cs.Opens
	}
}

// CloseCUDA destroys the server's own CUDA objects; call it after Close and
// before closing the device.
func (s *Server) CloseCUDA() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gpuDone != nil {
		_ = s.gpuDone.Destroy()
		s.gpuDone = nil
	}
}
