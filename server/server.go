// Package server is sonard's service: it binds the ipc protocol to the
// optimizer engine and the shared-memory bridge. It keeps one session per
// client (its attached segments and registered tensors), validates every
// request completely before touching memory, so a bad request changes no
// parameter or state byte, and releases a session's memory when the client
// says goodbye or the server stops.
package server

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Version is the release version of sonard and of the Python package (the
// repository's VERSION file; a test keeps them equal).
const Version = "0.1.0"

type tensor struct {
	*optimizer.Tensor
	id    uint32
	shape []int64
	seg   uint32
}

type session struct {
	client   string
	hello    ipc.Hello
	segments map[uint32]ipcbridge.Mapping
	tensors  map[uint32]*tensor
	lastSeen time.Time
	pidfd    int // the client process (pidfd_open), -1 when unknown
	// CUDA path (cuda.go): attached client allocations, tensors in them,
	// and the client's interprocess event.
	dsegments map[uint32]ipcbridge.DeviceMapping
	dtensors  map[uint32]*gpuTensor
	event     *cuda.Event
}

// Server implements ipc.Handler.
type Server struct {
	log      *zap.Logger
	mapper   ipcbridge.Mapper
	engine   *optimizer.Engine
	sessions map[string]*session
	nextID   uint32
	shutdown chan struct{}
	closed   atomic.Bool
	mu       sync.Mutex // guards the sessions against metrics scrapes
	m        *metrics
	gpu      *GPU        // nil: no CUDA path
	gpuDone  *cuda.Event // the server's completion event (created on first use)
	// IdleTimeout releases sessions without a watchable client process
	// after this long without a request (0: never).
	IdleTimeout time.Duration

	requests, errors, stepItems, bytesUpdated int64
	byOp                                      map[string]int64
	stepMicros                                []int64 // ring of recent step latencies
	stepMicrosN                               int
}

// New returns a server using mapper for client memory.
func New(log *zap.Logger, mapper ipcbridge.Mapper, engine *optimizer.Engine) *Server {
	return &Server{log: log, mapper: mapper, engine: engine, sessions: map[string]*session{},
		shutdown: make(chan struct{}), byOp: map[string]int64{}, stepMicros: make([]int64, 0, 4096), m: newMetrics()}
}

// Done is closed when a client asked the server to shut down.
func (s *Server) Done() <-chan struct{} { return s.shutdown }

func (s *Server) sess(client string) *session {
	ss := s.sessions[client]
	if ss == nil {
		ss = &session{client: client, segments: map[uint32]ipcbridge.Mapping{}, tensors: map[uint32]*tensor{}, pidfd: -1,
			dsegments: map[uint32]ipcbridge.DeviceMapping{}, dtensors: map[uint32]*gpuTensor{}}
		s.sessions[client] = ss
	}
	ss.lastSeen = time.Now()
	return ss
}

// Handle serves one request.
func (s *Server) Handle(client string, req ipc.Request) (any, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	start := time.Now()
	op := knownOp(req.Op)
	s.requests++
	s.byOp[op]++
	body, err := s.handle(client, req)
	var nb int64
	if rep, ok := body.(ipc.StepReply); ok {
		nb = rep.Bytes
	}
	s.observe(client, op, err, start, nb)
	if err != nil {
		s.errors++
		return nil, fmt.Errorf("%s (request %d): %w", req.Op, req.ID, err)
	}
	return body, nil
}

// knownOp is op when it is one of the protocol's operations, else "unknown":
// counters and metric labels never take arbitrary client strings.
func knownOp(op string) string {
	switch op {
	case ipc.OpHello, ipc.OpAttach, ipc.OpRegister, ipc.OpStep, ipc.OpExport, ipc.OpImport,
		ipc.OpDetach, ipc.OpStats, ipc.OpBye, ipc.OpShutdown, ipc.OpAttachCUDA, ipc.OpCUDAEvent:
		return op
	}
	return "unknown"
}

func (s *Server) handle(client string, req ipc.Request) (any, error) {
	switch req.Op {
	case ipc.OpHello:
		var h ipc.Hello
		if err := ipc.DecodeBody(req, &h); err != nil {
			return nil, err
		}
		ss := s.sess(client)
		ss.hello = h
		ss.watch(h.PID)
		s.log.Info("client connected", zap.String("client", client), zap.String("name", h.Client), zap.Int("pid", h.PID),
			zap.String("torch", h.Torch), zap.Int("threads", h.Threads), zap.String("capability", h.Capability))
		return ipc.HelloReply{Server: Version, Protocol: ipc.Version, PID: os.Getpid(), Workers: s.engine.Workers, Sqrt: s.engine.SqrtName,
			CUDA: s.cudaName()}, nil
	case ipc.OpAttach:
		var a ipc.Attach
		if err := ipc.DecodeBody(req, &a); err != nil {
			return nil, err
		}
		return s.attach(s.sess(client), a)
	case ipc.OpAttachCUDA:
		var a ipc.AttachCUDA
		if err := ipc.DecodeBody(req, &a); err != nil {
			return nil, err
		}
		return s.attachCUDA(s.sess(client), a)
	case ipc.OpCUDAEvent:
		var e ipc.CUDAEvent
		if err := ipc.DecodeBody(req, &e); err != nil {
			return nil, err
		}
		return s.cudaEvent(s.sess(client), e)
	case ipc.OpRegister:
		var r ipc.Register
		if err := ipc.DecodeBody(req, &r); err != nil {
			return nil, err
		}
		return s.register(s.sess(client), r)
	case ipc.OpStep:
		var st ipc.Step
		if err := ipc.DecodeBody(req, &st); err != nil {
			return nil, err
		}
		return s.step(s.sess(client), st)
	case ipc.OpExport, ipc.OpImport:
		var x ipc.StateXfer
		if err := ipc.DecodeBody(req, &x); err != nil {
			return nil, err
		}
		if req.Op == ipc.OpExport {
			return s.export(s.sess(client), x)
		}
		return s.importState(s.sess(client), x)
	case ipc.OpDetach:
		var d ipc.Detach
		if err := ipc.DecodeBody(req, &d); err != nil {
			return nil, err
		}
		return s.detach(s.sess(client), d)
	case ipc.OpStats:
		return s.stats(), nil
	case ipc.OpBye:
		s.release(client)
		return map[string]bool{"bye": true}, nil
	case ipc.OpShutdown:
		s.release(client)
		if s.closed.CompareAndSwap(false, true) {
			close(s.shutdown)
		}
		return map[string]bool{"shutdown": true}, nil
	}
	return nil, fmt.Errorf("%w: unknown op %q", ipc.ErrProtocol, req.Op)
}

func (s *Server) attach(ss *session, a ipc.Attach) (any, error) {
	m, err := s.mapper.Map(a.Shm, a.Size)
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	s.nextID++
	id := s.nextID
	ss.segments[id] = m
	s.log.Debug("segment attached", zap.String("client", ss.client), zap.String("shm", a.Shm), zap.Int64("size", a.Size), zap.Uint32("seg", id))
	return ipc.AttachReply{Seg: id}, nil
}

// memory resolves a MemRef of the session, checking range and alignment.
func (ss *session) memory(ref ipc.MemRef, want int64, align int64) ([]byte, error) {
	m := ss.segments[ref.Seg]
	if m == nil {
		if ss.dsegments[ref.Seg] != nil {
			return nil, fmt.Errorf("segment %d is CUDA memory, the tensor is CPU memory", ref.Seg)
		}
		return nil, fmt.Errorf("unknown segment %d", ref.Seg)
	}
	if ref.Bytes != want {
		return nil, fmt.Errorf("reference is %d bytes, tensor needs %d", ref.Bytes, want)
	}
	return m.Bytes(ref.Offset, ref.Bytes, align)
}

func (s *Server) register(ss *session, r ipc.Register) (any, error) {
	// Validate all first; register all or none.
	made := make([]*tensor, 0, len(r.Tensors))
	var dmade []*gpuTensor                   // CUDA tensors (parameter in an attach_cuda segment)
	isGPU := make([]bool, 0, len(r.Tensors)) // per spec, in request order
	names := make(map[string]bool, len(r.Tensors))
	for _, spec := range r.Tensors {
		d, err := optimizer.ParseDType(spec.DType)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", spec.Name, err)
		}
		for _, t := range ss.tensors {
			if t.Name == spec.Name {
				return nil, fmt.Errorf("tensor %q already registered (id %d)", spec.Name, t.id)
			}
		}
		for _, t := range ss.dtensors {
			if t.name == spec.Name {
				return nil, fmt.Errorf("tensor %q already registered (id %d)", spec.Name, t.id)
			}
		}
		if names[spec.Name] {
			return nil, fmt.Errorf("tensor %q appears twice", spec.Name)
		}
		names[spec.Name] = true
		if ss.dsegments[spec.Param.Seg] != nil {
			gt, err := s.prepareCUDATensor(ss, spec, d)
			if err != nil {
				return nil, err
			}
			dmade = append(dmade, gt)
			isGPU = append(isGPU, true)
			continue
		}
		numel := spec.Numel()
		nb := numel * int64(d.Size())
		mem, err := ss.memory(spec.Param, nb, int64(d.Size()))
		if err != nil {
			return nil, fmt.Errorf("tensor %q param: %w", spec.Name, err)
		}
		isGPU = append(isGPU, false)
		h := optimizer.Hyper{LR: spec.Hyper.LR, Beta1: spec.Hyper.Beta1, Beta2: spec.Hyper.Beta2, Eps: spec.Hyper.Eps,
			WeightDecay: spec.Hyper.WeightDecay, Amsgrad: spec.Hyper.Amsgrad, Maximize: spec.Hyper.Maximize}
		ot, err := optimizer.NewTensor(spec.Name, d, int(numel), h, mem)
		if err != nil {
			return nil, err
		}
		made = append(made, &tensor{Tensor: ot, shape: spec.Shape, seg: spec.Param.Seg})
	}
	if len(dmade) > 0 {
		if err := s.allocCUDATensors(dmade); err != nil {
			return nil, err
		}
	}
	ids := make([]uint32, len(isGPU))
	ci, gi := 0, 0
	for i, g := range isGPU {
		s.nextID++
		ids[i] = s.nextID
		if g {
			dmade[gi].id = s.nextID
			ss.dtensors[s.nextID] = dmade[gi]
			gi++
		} else {
			made[ci].id = s.nextID
			ss.tensors[s.nextID] = made[ci]
			ci++
		}
	}
	s.log.Debug("tensors registered", zap.String("client", ss.client), zap.Int("count", len(ids)))
	return ipc.RegisterReply{IDs: ids}, nil
}

type stepWork struct {
	t    *tensor
	grad []byte
	it   ipc.StepItem
}

func (s *Server) step(ss *session, st ipc.Step) (any, error) {
	if ss.dtensors[st.Items[0].Tensor] != nil {
		return s.stepCUDA(ss, st)
	}
	if st.WaitEvent {
		return nil, errors.New("wait_event is for CUDA tensors only")
	}
	start := time.Now()
	work := make([]stepWork, 0, len(st.Items))
	for i, it := range st.Items {
		t := ss.tensors[it.Tensor]
		if t == nil {
			if ss.dtensors[it.Tensor] != nil {
				return nil, fmt.Errorf("item %d: tensor %d is a CUDA tensor: one step request holds CPU or CUDA tensors, not both", i, it.Tensor)
			}
			return nil, fmt.Errorf("item %d: unknown tensor %d", i, it.Tensor)
		}
		var grad []byte
		if it.Grad.Seg != 0 {
			g, err := ss.memory(it.Grad, int64(t.Bytes()), int64(t.DType.Size()))
			if err != nil {
				return nil, fmt.Errorf("item %d (%s) grad: %w", i, t.Name, err)
			}
			if overlaps(g, t.Param) {
				return nil, fmt.Errorf("item %d (%s): gradient memory overlaps the parameter", i, t.Name)
			}
			grad = g
		} else if t.Pending() == 0 {
			return nil, fmt.Errorf("item %d (%s): nothing accumulated to apply", i, t.Name)
		}
		if it.Apply {
			if it.Scalars.Amsgrad != t.Hyper.Amsgrad || it.Scalars.Maximize != t.Hyper.Maximize {
				return nil, fmt.Errorf("item %d (%s): amsgrad/maximize differ from registration", i, t.Name)
			}
			if it.Step != t.Step+1 {
				return nil, fmt.Errorf("item %d (%s): client step %d but server is at step %d", i, t.Name, it.Step, t.Step)
			}
		}
		work = append(work, stepWork{t: t, grad: grad, it: it})
	}
	var rep ipc.StepReply
	for _, w := range work {
		var err error
		if w.it.Apply {
			sc := w.it.Scalars
			err = s.engine.Apply(w.t.Tensor, w.grad, optimizer.Scalars{Decay: sc.Decay, ApplyDecay: sc.ApplyDecay,
				Beta1W: sc.Beta1W, Beta2: sc.Beta2, OneMinusB2: sc.OneMinusB2, NegStepSize: sc.NegStepSize,
				BC2Sqrt: sc.BC2Sqrt, Eps: sc.Eps, Amsgrad: sc.Amsgrad, Maximize: sc.Maximize})
			rep.Applied++
		} else {
			err = s.engine.Accumulate(w.t.Tensor, w.grad)
			rep.Accumulated++
		}
		if err != nil { // validated above: only reachable on an engine bug
			return nil, fmt.Errorf("tensor %s: %w", w.t.Name, err)
		}
		rep.Bytes += int64(w.t.Bytes())
	}
	rep.Micros = time.Since(start).Microseconds()
	s.stepItems += int64(len(work))
	s.bytesUpdated += rep.Bytes
	s.recordLatency(rep.Micros)
	return rep, nil
}

func overlaps(a, b []byte) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	a0, a1 := addr(a), addr(a)+uintptr(len(a))
	b0, b1 := addr(b), addr(b)+uintptr(len(b))
	return a0 < b1 && b0 < a1
}

func (s *Server) recordLatency(us int64) {
	if len(s.stepMicros) < cap(s.stepMicros) {
		s.stepMicros = append(s.stepMicros, us)
	} else {
		s.stepMicros[s.stepMicrosN%len(s.stepMicros)] = us
	}
	s.stepMicrosN++
}

// stateMem resolves the three state references of a transfer; all must be
// distinct from each other and from the parameter.
func (ss *session) stateMem(t *tensor, x ipc.StateXfer) ([3][]byte, error) {
	var out [3][]byte
	refs := []ipc.MemRef{x.ExpAvg, x.ExpAvgSq}
	if t.Hyper.Amsgrad {
		refs = append(refs, x.MaxExpAvgSq)
	}
	for i, r := range refs {
		b, err := ss.memory(r, int64(t.Bytes()), int64(t.DType.Size()))
		if err != nil {
			return out, fmt.Errorf("tensor %s state part %d: %w", t.Name, i, err)
		}
		if overlaps(b, t.Param) {
			return out, fmt.Errorf("tensor %s state part %d overlaps the parameter", t.Name, i)
		}
		for j := 0; j < i; j++ {
			if overlaps(b, out[j]) {
				return out, fmt.Errorf("tensor %s state parts %d and %d overlap", t.Name, j, i)
			}
		}
		out[i] = b
	}
	return out, nil
}

// stateXfer resolves the tensor and state memory of an export or import;
// the tensor must have no accumulated gradient waiting to be applied.
func (ss *session) stateXfer(x ipc.StateXfer) (*tensor, [3][]byte, error) {
	t := ss.tensors[x.Tensor]
	if t == nil {
		return nil, [3][]byte{}, fmt.Errorf("unknown tensor %d", x.Tensor)
	}
	if t.Pending() > 0 {
		return nil, [3][]byte{}, fmt.Errorf("tensor %s has %d accumulated gradients not yet applied", t.Name, t.Pending())
	}
	mem, err := ss.stateMem(t, x)
	return t, mem, err
}

func (s *Server) export(ss *session, x ipc.StateXfer) (any, error) {
	if t := ss.dtensors[x.Tensor]; t != nil {
		return s.xferCUDA(ss, t, x, true)
	}
	t, mem, err := ss.stateXfer(x)
	if err != nil {
		return nil, err
	}
	copy(mem[0], t.ExpAvg)
	copy(mem[1], t.ExpAvgSq)
	if t.Hyper.Amsgrad {
		copy(mem[2], t.MaxExpAvgSq)
	}
	return ipc.ExportReply{Step: t.Step, Amsgrad: t.Hyper.Amsgrad}, nil
}

func (s *Server) importState(ss *session, x ipc.StateXfer) (any, error) {
	if t := ss.dtensors[x.Tensor]; t != nil {
		return s.xferCUDA(ss, t, x, false)
	}
	t, mem, err := ss.stateXfer(x)
	if err != nil {
		return nil, err
	}
	if err := t.ImportState(x.Step, mem[0], mem[1], mem[2]); err != nil {
		return nil, err
	}
	return ipc.ExportReply{Step: t.Step, Amsgrad: t.Hyper.Amsgrad}, nil
}

func (s *Server) detach(ss *session, d ipc.Detach) (any, error) {
	if ok, err := s.detachCUDA(ss, d.Seg); ok {
		if err != nil {
			return nil, err
		}
		return map[string]uint32{"seg": d.Seg}, nil
	}
	m := ss.segments[d.Seg]
	if m == nil {
		return nil, fmt.Errorf("unknown segment %d", d.Seg)
	}
	for _, t := range ss.tensors {
		if t.seg == d.Seg {
			return nil, fmt.Errorf("segment %d holds tensor %s: cannot detach", d.Seg, t.Name)
		}
	}
	delete(ss.segments, d.Seg)
	if err := m.Close(); err != nil {
		return nil, err
	}
	return map[string]uint32{"seg": d.Seg}, nil
}

// Stats returns the server's counters.
func (s *Server) Stats() ipc.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats()
}

func (s *Server) stats() ipc.Stats {
	st := ipc.Stats{Requests: s.requests, Errors: s.errors, StepItems: s.stepItems, BytesUpdated: s.bytesUpdated,
		Sessions: len(s.sessions), ByOp: map[string]int64{}}
	for k, v := range s.byOp {
		st.ByOp[k] = v
	}
	for _, ss := range s.sessions {
		st.Tensors += len(ss.tensors)
		st.Segments += len(ss.segments)
		for _, t := range ss.tensors {
			st.StateBytes += int64(t.StateBytes())
		}
		for _, m := range ss.segments {
			st.SegmentBytes += m.Size()
		}
	}
	s.cudaStats(&st)
	if n := len(s.stepMicros); n > 0 {
		l := append([]int64(nil), s.stepMicros...)
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		st.StepMicrosP50 = l[n/2]
		st.StepMicrosP99 = l[(n*99)/100]
		st.StepMicrosMax = l[n-1]
	}
	return st
}

// watch ties the session to the client process, so that its memory is freed
// as soon as that process exits (see Tick).
func (ss *session) watch(pid int) {
	if ss.pidfd >= 0 {
		_ = unix.Close(ss.pidfd)
		ss.pidfd = -1
	}
	if pid <= 0 {
		return
	}
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		ss.pidfd = fd
	}
}

// exited reports whether the session's client process has exited.
func (ss *session) exited() bool {
	if ss.pidfd < 0 {
		return false
	}
	fds := []unix.PollFd{{Fd: int32(ss.pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&unix.POLLIN != 0
}

// Tick releases the sessions of clients that exited (their process is gone)
// and of clients not on this host (no process to watch) that have been
// silent for longer than IdleTimeout. The transport calls it about once a
// second.
func (s *Server) Tick(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c, ss := range s.sessions {
		switch {
		case ss.exited():
			s.log.Warn("client process exited without saying goodbye: releasing its session",
				zap.String("client", c), zap.Int("pid", ss.hello.PID))
			s.release(c)
		case ss.pidfd < 0 && s.IdleTimeout > 0 && now.Sub(ss.lastSeen) > s.IdleTimeout:
			s.log.Warn("client silent for too long: releasing its session", zap.String("client", c),
				zap.Duration("idle", now.Sub(ss.lastSeen)))
			s.release(c)
		}
	}
}

// release frees a client's tensors and unmaps its segments.
func (s *Server) release(client string) {
	ss := s.sessions[client]
	if ss == nil {
		return
	}
	var errs []error
	for _, m := range ss.segments {
		errs = append(errs, m.Close())
	}
	errs = append(errs, s.releaseCUDA(ss)...)
	if err := errors.Join(errs...); err != nil {
		s.log.Warn("releasing session", zap.String("client", client), zap.Error(err))
	}
	if ss.pidfd >= 0 {
		_ = unix.Close(ss.pidfd)
	}
	delete(s.sessions, client)
	s.log.Info("client released", zap.String("client", client), zap.Int("tensors", len(ss.tensors)), zap.Int("segments", len(ss.segments)))
}

// Close releases every session.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.sessions {
		s.release(c)
	}
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }
