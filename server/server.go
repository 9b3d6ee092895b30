// Package server is sonard's service: it binds the ipc protocol to the
// backends that own client memory and optimizer state (package backend: the
// CPU one, and the CUDA one where a device exists). It keeps one session per
// client (its segments, its tensors, one backend session per backend it
// uses), validates every request completely before touching memory, so a bad
// request changes no parameter or state byte, and releases a session's
// memory when the client says goodbye, its process exits, or the server
// stops. A segment's backend is chosen once, by the request that attaches
// it; its tensors follow it, and no handler branches on the backend again.
package server

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sonar-moe/sonar"
	"github.com/sonar-moe/sonar/backend"
	"github.com/sonar-moe/sonar/internal/clip"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
	"go.uber.org/zap"
)

// maxPathBytes is PATH_MAX: a longer sqrt_lib cannot name a file.
const maxPathBytes = 4096

// Version is the release version of sonard (the repository's VERSION file).
var Version = sonar.Version

// SqrtLoader loads the float32 square root a client's torch uses from the
// library it names; name describes it ("mkl:<path>").
type SqrtLoader func(path string) (sqrt optimizer.Sqrt, name string, err error)

// Backends names the backend each attach operation uses.
var opBackend = map[string]string{ipc.OpAttach: "cpu", ipc.OpAttachProcess: "cpu", ipc.OpAttachCUDA: "cuda", ipc.OpCUDAEvent: "cuda"}

type segment struct {
	id      uint32
	backend string
	mem     backend.Memory // where the backend keeps it (and the state of tensors in it)
	seg     backend.Segment
}

type tensor struct {
	id    uint32
	name  string
	dtype optimizer.DType
	numel int64
	shape []int64
	hyper optimizer.Hyper
	seg   *segment
	param backend.Ref
	state backend.Tensor
}

func (t *tensor) bytes() int64 { return t.numel * int64(t.dtype.Size()) }

type session struct {
	client   string
	hello    ipc.Hello
	sqrt     optimizer.Sqrt
	sqrtName string
	open     map[string]backend.Session // by backend name, opened on first use
	segments map[uint32]*segment
	tensors  map[uint32]*tensor
	names    map[string]uint32 // tensor name -> id: register is linear in the tensors it adds
	// staged are tensors of register requests with More, validated but
	// without state or id until a register without More (stagedNames:
	// their names, for the uniqueness check).
	staged      []*tensor
	stagedNames map[string]bool
	lastSeen    time.Time
	// goneAt is when the client's connection closed (zero while it is
	// open); the session is released ReconnectGrace later unless the client
	// is back (see lifetime.go).
	goneAt time.Time
}

// Server implements ipc.Handler.
// PeerLookup finds the process of a connected client (ipc.Transport).
type PeerLookup interface {
	PeerPID(client string) (int, error)
}

type Server struct {
	log      *zap.Logger
	backends map[string]backend.Backend
	unavail  map[string]string // backend name -> why it is missing
	sessions map[string]*session
	nextID   uint32
	shutdown chan struct{}
	closed   atomic.Bool
	mu       sync.Mutex // guards the sessions against metrics scrapes
	m        *metrics
	// Workers is what hello reports of the CPU engine.
	Workers int
	// LoadSqrt loads a client's float32 square root (nil: every client
	// must use the IEEE one).
	LoadSqrt SqrtLoader
	// LocalClients says every client is a process of this user on this host
	// (an ipc:// socket, mode 0600): they may name any library to load.
	LocalClients bool
	// TrustedSqrtLibs are the libraries any client may name, local or not
	// (the operator's --trusted-sqrt-lib).
	TrustedSqrtLibs map[string]bool
	// IdleTimeout releases sessions whose connection the transport cannot
	// watch after this long without a request (0: never).
	IdleTimeout time.Duration
	// MaxStateBytes bounds the optimizer state (and gradient-accumulation
	// buffers) the server holds in host memory for all sessions together,
	// MaxSessionStateBytes for one session; 0: no bound. A register or an
	// accumulating step that would pass either is refused and changes
	// nothing. CUDA tensors' state lives in device memory and is not counted.
	MaxStateBytes, MaxSessionStateBytes int64
	// MaxSegments bounds the segments attached by all sessions together,
	// MaxSessionSegments those of one session (0: no bound). Each holds a
	// file descriptor (and a mapping): sonard chooses them from its
	// RLIMIT_NOFILE (package fdlimit), so that clients can never take the
	// descriptors the server needs to accept connections.
	MaxSegments, MaxSessionSegments int
	// ReconnectGrace is how long a session outlives its closed connection,
	// for the client to come back with the same routing id (lifetime.go).
	ReconnectGrace time.Duration
	// AdminToken, when set, is the secret a shutdown request must carry (the
	// private server's owner, or an operator); empty: shutdown is refused.
	AdminToken string
	// Peers tells a client's process id (the transport's peer
	// credentials); nil: attach_process is refused.
	Peers   PeerLookup
	watched map[string]bool // clients whose connection the transport watches

	requests, errors, stepItems, bytesUpdated int64
	byOp                                      map[string]int64
	stepMicros                                []int64 // ring of recent step latencies
	stepMicrosN                               int
}

// New returns a server over the given backends (by their Name).
func New(log *zap.Logger, backends ...backend.Backend) *Server {
	s := &Server{log: log, backends: map[string]backend.Backend{}, unavail: map[string]string{}, sessions: map[string]*session{},
		shutdown: make(chan struct{}), byOp: map[string]int64{}, stepMicros: make([]int64, 0, 4096), m: newMetrics(),
		watched: map[string]bool{}, ReconnectGrace: DefaultReconnectGrace}
	for _, b := range backends {
		s.backends[b.Name()] = b
	}
	return s
}

// Unavailable records why a backend is missing (said in the refusal of its
// requests).
func (s *Server) Unavailable(name, why string) { s.unavail[name] = why }

// Done is closed when a client asked the server to shut down.
func (s *Server) Done() <-chan struct{} { return s.shutdown }

func (s *Server) sess(client string) *session {
	ss := s.sessions[client]
	if ss == nil {
		ss = &session{client: client, open: map[string]backend.Session{}, segments: map[uint32]*segment{},
			tensors: map[uint32]*tensor{}, names: map[string]uint32{}, sqrtName: "ieee"}
		s.sessions[client] = ss
	}
	ss.lastSeen = time.Now()
	ss.goneAt = time.Time{}
	return ss
}

// backendSession returns the session's session of backend name, opening it
// on first use.
func (s *Server) backendSession(ss *session, name string) (backend.Session, error) {
	if bs := ss.open[name]; bs != nil {
		return bs, nil
	}
	b := s.backends[name]
	if b == nil {
		why := s.unavail[name]
		if why == "" {
			why = "not enabled"
		}
		return nil, &backend.ErrUnavailable{Name: name, Why: why}
	}
	bs, err := b.Open(backend.Client{Name: ss.client, Sqrt: ss.sqrt, SqrtName: ss.sqrtName})
	if err != nil {
		return nil, fmt.Errorf("%s backend: %w", name, err)
	}
	ss.open[name] = bs
	return bs, nil
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
		return nil, fmt.Errorf("%s (request %d): %w", clip.String(req.Op), req.ID, err)
	}
	return body, nil
}

// knownOp is op when it is one of the protocol's operations, else "unknown":
// counters and metric labels never take arbitrary client strings.
func knownOp(op string) string {
	switch op {
	case ipc.OpHello, ipc.OpAttach, ipc.OpRegister, ipc.OpStep, ipc.OpExport, ipc.OpImport,
		ipc.OpDetach, ipc.OpStats, ipc.OpPing, ipc.OpBye, ipc.OpShutdown, ipc.OpAttachCUDA, ipc.OpCUDAEvent, ipc.OpAttachProcess,
		ipc.OpDiscard:
		return op
	}
	return "unknown"
}

// decode decodes req's body into a fresh T and calls f with it.
func decode[T any](req ipc.Request, f func(T) (any, error)) (any, error) {
	var v T
	if err := ipc.DecodeBody(req, &v); err != nil {
		return nil, err
	}
	return f(v)
}

func (s *Server) handle(client string, req ipc.Request) (any, error) {
	switch req.Op {
	case ipc.OpHello:
		return decode(req, func(h ipc.Hello) (any, error) { return s.hello(s.sess(client), h) })
	case ipc.OpAttach:
		return decode(req, func(a ipc.Attach) (any, error) { return s.attach(s.sess(client), req.Op, []byte(a.Shm), a.Size) })
	case ipc.OpAttachCUDA:
		return decode(req, func(a ipc.AttachCUDA) (any, error) { return s.attach(s.sess(client), req.Op, a.Handle, a.Size) })
	case ipc.OpCUDAEvent:
		return decode(req, func(e ipc.CUDAEvent) (any, error) { return s.event(s.sess(client), e) })
	case ipc.OpAttachProcess:
		return decode(req, func(a ipc.AttachProcess) (any, error) { return s.attachProcess(s.sess(client), a) })
	case ipc.OpRegister:
		return decode(req, func(r ipc.Register) (any, error) { return s.register(s.sess(client), r) })
	case ipc.OpStep:
		return decode(req, func(st ipc.Step) (any, error) { return s.step(s.sess(client), st) })
	case ipc.OpExport:
		return decode(req, func(x ipc.StateXfer) (any, error) { return s.transfer(s.sess(client), x, true) })
	case ipc.OpImport:
		return decode(req, func(x ipc.StateXfer) (any, error) { return s.transfer(s.sess(client), x, false) })
	case ipc.OpDetach:
		return decode(req, func(d ipc.Detach) (any, error) { return s.detach(s.sess(client), d) })
	case ipc.OpDiscard:
		return decode(req, func(d ipc.Discard) (any, error) { return s.discard(s.sess(client), d) })
	case ipc.OpStats:
		return s.stats(), nil
	case ipc.OpPing:
		return nil, nil
	case ipc.OpBye:
		s.release(client)
		return ipc.ByeReply{Bye: true}, nil
	case ipc.OpShutdown:
		if err := s.mayShutdown(req); err != nil {
			return nil, err
		}
		s.release(client)
		if s.closed.CompareAndSwap(false, true) {
			close(s.shutdown)
		}
		return ipc.ShutdownReply{Shutdown: true}, nil
	}
	return nil, fmt.Errorf("%w: unknown op %s", ipc.ErrProtocol, clip.Quote(req.Op))
}

func (s *Server) hello(ss *session, h ipc.Hello) (any, error) {
	sqrt, name := optimizer.Sqrt{}, "ieee"
	if h.SqrtLib != "" {
		switch {
		case !s.LocalClients && !s.TrustedSqrtLibs[h.SqrtLib]:
			return nil, fmt.Errorf("sqrt_lib %s: a tcp:// sonard loads only the libraries its operator trusts (--trusted-sqrt-lib); "+
				"an ipc:// sonard accepts any from clients on this host", clip.Quote(h.SqrtLib))
		case s.LoadSqrt == nil:
			return nil, errors.New("this sonard cannot load a client's float32 sqrt library")
		case !strings.HasPrefix(h.SqrtLib, "/"):
			return nil, fmt.Errorf("sqrt_lib %s: want an absolute path", clip.Quote(h.SqrtLib))
		case len(h.SqrtLib) > maxPathBytes:
			return nil, fmt.Errorf("sqrt_lib %s: longer than a path can be (%d bytes)", clip.Quote(h.SqrtLib), maxPathBytes)
		}
		var err error
		if sqrt, name, err = s.LoadSqrt(h.SqrtLib); err != nil {
			return nil, fmt.Errorf("sqrt_lib: %w", err)
		}
	}
	if _, opened := ss.open["cpu"]; opened && name != ss.sqrtName {
		return nil, fmt.Errorf("hello changes the float32 sqrt (%s -> %s) of a session that already attached memory", ss.sqrtName, name)
	}
	ss.hello, ss.sqrt, ss.sqrtName = h, sqrt, name
	s.log.Info("client connected", zap.String("client", ss.client), clip.Field("name", h.Client), zap.Int("pid", h.PID),
		clip.Field("torch", h.Torch), zap.Int("threads", h.Threads), clip.Field("capability", h.Capability), zap.String("sqrt", name))
	rep := ipc.HelloReply{Server: Version, Protocol: ipc.Version, PID: os.Getpid(), Workers: s.Workers, Sqrt: name,
		ISA: optimizer.KernelISA().String(), ReconnectGraceMillis: s.ReconnectGrace.Milliseconds(), Features: []string{ipc.FeatureGradScale, ipc.FeatureDiscard, ipc.FeatureRegisterMore}}
	if b := s.backends["cuda"]; b != nil {
		rep.CUDA = b.Describe()
	}
	return rep, nil
}

// segmentRoom refuses one more segment for the session when it or all
// sessions together hold as many as they may.
func (s *Server) segmentRoom(ss *session) error {
	if lim := s.MaxSessionSegments; lim > 0 && len(ss.segments) >= lim {
		return fmt.Errorf("too many segments attached: %d by this session (limit %d a session); detach some first",
			len(ss.segments), lim)
	}
	if lim := s.MaxSegments; lim > 0 {
		all := 0
		for _, o := range s.sessions {
			all += len(o.segments)
		}
		if all >= lim {
			return fmt.Errorf("too many segments attached: %d by all sessions (limit %d)", all, lim)
		}
	}
	return nil
}

func (s *Server) attach(ss *session, op string, handle []byte, size int64) (any, error) {
	if err := s.segmentRoom(ss); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	name := opBackend[op]
	bs, err := s.backendSession(ss, name)
	if err != nil {
		return nil, err
	}
	seg, err := bs.Attach(handle, size)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	s.nextID++
	ss.segments[s.nextID] = &segment{id: s.nextID, backend: name, mem: s.backends[name].Memory(), seg: seg}
	s.log.Debug("segment attached", zap.String("client", ss.client), zap.String("backend", name), zap.String("name", seg.Name()),
		zap.Int64("size", seg.Size()), zap.Uint32("seg", s.nextID))
	return ipc.AttachReply{Seg: s.nextID}, nil
}

// attachProcess makes the client's own memory a segment of gradients: the
// process is the one at the other end of the connection, proven readable by
// the probe.
func (s *Server) attachProcess(ss *session, a ipc.AttachProcess) (any, error) {
	if s.Peers == nil {
		return nil, errors.New("attach_process: this sonard cannot tell its clients' processes")
	}
	if err := s.segmentRoom(ss); err != nil {
		return nil, fmt.Errorf("attach_process: %w", err)
	}
	pid, err := s.Peers.PeerPID(ss.client)
	if err != nil {
		return nil, fmt.Errorf("attach_process: %w", err)
	}
	bs, err := s.backendSession(ss, opBackend[ipc.OpAttachProcess])
	if err != nil {
		return nil, err
	}
	pa, ok := bs.(backend.ProcessAttacher)
	if !ok {
		return nil, errors.New("attach_process: this backend cannot read a client's memory")
	}
	seg, err := pa.AttachProcess(pid, a.ProbeAddr, a.Probe)
	if err != nil {
		return nil, fmt.Errorf("attach_process: %w", err)
	}
	s.nextID++
	name := opBackend[ipc.OpAttachProcess]
	ss.segments[s.nextID] = &segment{id: s.nextID, backend: name, mem: s.backends[name].Memory(), seg: seg}
	s.log.Debug("client memory attached", zap.String("client", ss.client), zap.Int("pid", pid), zap.Uint32("seg", s.nextID))
	return ipc.AttachReply{Seg: s.nextID}, nil
}

func (s *Server) event(ss *session, e ipc.CUDAEvent) (any, error) {
	bs, err := s.backendSession(ss, opBackend[ipc.OpCUDAEvent])
	if err != nil {
		return nil, err
	}
	if err := bs.SetEvent(e.Handle); err != nil {
		return nil, fmt.Errorf("cuda_event: %w", err)
	}
	return ipc.EventReply{Event: true}, nil
}

// verifier checks that each segment a request uses still has all its memory
// (Segment.Verify: an fstat for shared memory), once per request however many
// references name it.
type verifier map[*segment]error

func (v verifier) check(seg *segment) error {
	err, done := v[seg]
	if !done {
		err = seg.seg.Verify()
		v[seg] = err
	}
	return err
}

// resolve checks a reference of the session: its segment, the size the
// tensor needs, the range, and that the segment's memory is all there.
func (ss *session) resolve(ref ipc.MemRef, want, align int64, v verifier) (*segment, backend.Ref, error) {
	seg := ss.segments[ref.Seg]
	if seg == nil {
		return nil, backend.Ref{}, fmt.Errorf("unknown segment %d", ref.Seg)
	}
	if ref.Bytes != want {
		return nil, backend.Ref{}, fmt.Errorf("reference is %d bytes, tensor needs %d", ref.Bytes, want)
	}
	r, err := backend.Resolve(seg.seg, ref.Offset, ref.Bytes, align)
	if err == nil {
		err = v.check(seg)
	}
	return seg, r, err
}

// resolveFor is resolve for memory that must belong to t's backend.
func (ss *session) resolveFor(t *tensor, ref ipc.MemRef, v verifier) (backend.Ref, error) {
	seg, r, err := ss.resolve(ref, t.bytes(), int64(t.dtype.Size()), v)
	if err != nil {
		return r, err
	}
	if seg.backend != t.seg.backend {
		return r, fmt.Errorf("segment %d is %s memory, the tensor is %s memory", ref.Seg, seg.backend, t.seg.backend)
	}
	if r.Overlaps(t.param) {
		return r, errors.New("memory overlaps the parameter")
	}
	return r, nil
}

// register registers r's tensors, or stages them (r.More); an error drops
// whatever the session had staged, so that nothing of the registration
// happens.
func (s *Server) register(ss *session, r ipc.Register) (any, error) {
	reply, err := s.registerOrStage(ss, r)
	if err != nil && len(ss.staged) > 0 {
		err = fmt.Errorf("%w (and the %d tensors staged by earlier register requests were dropped)",
			err, len(ss.staged))
	}
	if err != nil || !r.More {
		ss.staged, ss.stagedNames = nil, nil
	}
	return reply, err
}

func (s *Server) registerOrStage(ss *session, r ipc.Register) (any, error) {
	if r.More && len(ss.staged)+len(r.Tensors) > ipc.MaxStaged {
		return nil, fmt.Errorf("%d tensors staged with more (want at most %d)", len(ss.staged)+len(r.Tensors), ipc.MaxStaged)
	}
	// Validate all first; register all or none.
	made := make([]*tensor, 0, len(r.Tensors))
	v := verifier{}
	names := make(map[string]bool, len(r.Tensors)) // this request's
	for _, spec := range r.Tensors {
		d, err := optimizer.ParseDType(spec.DType)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", spec.Name, err)
		}
		if id, ok := ss.names[spec.Name]; ok {
			return nil, fmt.Errorf("tensor %q already registered (id %d)", spec.Name, id)
		}
		if names[spec.Name] || ss.stagedNames[spec.Name] {
			return nil, fmt.Errorf("tensor %q appears twice", spec.Name)
		}
		names[spec.Name] = true
		h := optimizer.Hyper{LR: spec.Hyper.LR, Beta1: spec.Hyper.Beta1, Beta2: spec.Hyper.Beta2, Eps: spec.Hyper.Eps,
			WeightDecay: spec.Hyper.WeightDecay, Amsgrad: spec.Hyper.Amsgrad, Maximize: spec.Hyper.Maximize}
		if err := h.Validate(); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", spec.Name, err)
		}
		t := &tensor{name: spec.Name, dtype: d, numel: spec.Numel(), shape: spec.Shape, hyper: h}
		seg, param, err := ss.resolve(spec.Param, t.bytes(), int64(d.Size()), v)
		if err != nil {
			return nil, fmt.Errorf("tensor %q param: %w", spec.Name, err)
		}
		t.seg, t.param = seg, param
		made = append(made, t)
	}
	if r.More {
		if ss.stagedNames == nil {
			ss.stagedNames = make(map[string]bool, len(made))
		}
		for _, t := range made {
			ss.stagedNames[t.name] = true
		}
		ss.staged = append(ss.staged, made...)
		return ipc.RegisterReply{IDs: []uint32{}}, nil
	}
	made = append(ss.staged, made...)
	// One request registers tensors of one backend, whose Create is all or
	// none; a request mixing backends is refused before any state is made.
	for _, t := range made[min(1, len(made)):] {
		if t.seg.backend != made[0].seg.backend {
			return nil, fmt.Errorf("tensor %q is %s memory, tensor %q is %s memory: one register request holds one kind",
				t.name, t.seg.backend, made[0].name, made[0].seg.backend)
		}
	}
	if len(made) > 0 {
		var need int64
		for _, t := range made {
			need += optimizer.StateBytesFor(t.dtype, t.numel, t.hyper.Amsgrad)
		}
		if err := s.checkBudget(ss, made[0].seg.mem, need, fmt.Sprintf("the optimizer state of %d tensors", len(made))); err != nil {
			return nil, fmt.Errorf("%w; nothing was registered", err)
		}
	}
	if len(made) > 0 {
		bs, err := s.backendSession(ss, made[0].seg.backend)
		if err != nil {
			return nil, err
		}
		specs := make([]backend.Spec, len(made))
		for i, t := range made {
			specs[i] = backend.Spec{Name: t.name, DType: t.dtype, Numel: t.numel, Hyper: t.hyper, Param: t.param}
		}
		states, err := bs.Create(specs)
		if err != nil {
			return nil, err
		}
		for i, t := range made {
			t.state = states[i]
		}
	}
	ids := make([]uint32, len(made))
	for i, t := range made {
		s.nextID++
		t.id = s.nextID
		ids[i] = t.id
		ss.tensors[t.id] = t
		ss.names[t.name] = t.id
	}
	s.log.Debug("tensors registered", zap.String("client", ss.client), zap.Int("count", len(ids)))
	return ipc.RegisterReply{IDs: ids}, nil
}

func scalarsOf(sc ipc.ScalarsMsg) optimizer.Scalars {
	return optimizer.Scalars{Decay: sc.Decay, ApplyDecay: sc.ApplyDecay, Beta1W: sc.Beta1W, Beta2: sc.Beta2,
		OneMinusB2: sc.OneMinusB2, NegStepSize: sc.NegStepSize, BC2Sqrt: sc.BC2Sqrt, Eps: sc.Eps,
		Amsgrad: sc.Amsgrad, Maximize: sc.Maximize, Fused: sc.Fused, Lanes: sc.Lanes,
		LR: sc.LR, Beta1: sc.Beta1, WeightDecay: sc.WeightDecay, FusedDouble: sc.FusedDouble}
}

func (s *Server) step(ss *session, st ipc.Step) (any, error) {
	start := time.Now()
	items := make([]backend.Item, 0, len(st.Items))
	var rep ipc.StepReply
	var first *tensor
	var accum int64
	v := verifier{}
	seen := make(map[*tensor]struct{}, len(st.Items)) // a scan of the items so far was quadratic: 9 ms for 768 tensors
	if st.Norms {
		rep.SqNorms = make([]float64, len(st.Items))
	}
	for i, it := range st.Items {
		t := ss.tensors[it.Tensor]
		if t == nil {
			return nil, fmt.Errorf("item %d: unknown tensor %d", i, it.Tensor)
		}
		if first == nil {
			first = t
		} else if t.seg.backend != first.seg.backend {
			return nil, fmt.Errorf("item %d: tensor %d is %s memory, item 0 is %s memory: one step request holds one kind, not both",
				i, it.Tensor, t.seg.backend, first.seg.backend)
		}
		if _, twice := seen[t]; twice {
			return nil, fmt.Errorf("item %d (%s): tensor appears twice in one request", i, t.name)
		}
		seen[t] = struct{}{}
		if err := t.state.Damage(); err != nil {
			return nil, fmt.Errorf("item %d (%s): refused, the tensor is damaged: %w", i, t.name, err)
		}
		if err := v.check(t.seg); err != nil {
			return nil, fmt.Errorf("item %d (%s) param: %w", i, t.name, err)
		}
		if !it.Apply && t.state.Pending() == 0 {
			accum += t.bytes() // the accumulation buffer the first micro-batch allocates
		}
		item := backend.Item{Tensor: t.state, Apply: it.Apply, Scalars: scalarsOf(it.Scalars),
			Prep: optimizer.GradPrep{Scale: float32(it.GradScale), Norm: st.Norms && it.Apply}}
		if st.Norms && it.Apply {
			item.SqNorm = &rep.SqNorms[i]
		}
		if it.Grad.Seg != 0 {
			g, err := ss.resolveFor(t, it.Grad, v)
			if err != nil {
				return nil, fmt.Errorf("item %d (%s) grad: %w", i, t.name, err)
			}
			item.Grad = &g
		} else if t.state.Pending() == 0 {
			return nil, fmt.Errorf("item %d (%s): nothing accumulated to apply", i, t.name)
		}
		if it.Apply {
			// maximize is the step's (torch lets a script toggle a group's
			// maximize between steps; the kernels take it from the scalars);
			// amsgrad must be the registration's: the state's layout
			// (max_exp_avg_sq) depends on it.
			if it.Scalars.Amsgrad != t.hyper.Amsgrad {
				return nil, fmt.Errorf("item %d (%s): amsgrad differs from registration (registered amsgrad=%v)", i, t.name, t.hyper.Amsgrad)
			}
			if it.Step != t.state.Step()+1 {
				return nil, fmt.Errorf("item %d (%s): client step %d but server is at step %d", i, t.name, it.Step, t.state.Step())
			}
			rep.Applied++
		} else {
			rep.Accumulated++
		}
		rep.Bytes += t.bytes()
		items = append(items, item)
	}
	if first == nil {
		return nil, fmt.Errorf("%w: step without items", ipc.ErrProtocol)
	}
	if err := s.checkBudget(ss, first.seg.mem, accum, "gradient accumulation buffers"); err != nil {
		return nil, err
	}
	bs, err := s.backendSession(ss, first.seg.backend)
	if err != nil {
		return nil, err
	}
	if err := bs.Step(items, st.WaitEvent); err != nil {
		return nil, err
	}
	rep.Micros = time.Since(start).Microseconds()
	s.stepItems += int64(len(items))
	s.bytesUpdated += rep.Bytes
	s.recordLatency(rep.Micros)
	return rep, nil
}

// hostStateBytes is the host memory the server holds for the session's
// tensors (optimizer state and accumulation buffers), and for all sessions.
func (s *Server) hostStateBytes(ss *session) (mine, all int64) {
	for _, o := range s.sessions {
		n := o.held()[backend.Host].stateBytes
		all += n
		if o == ss {
			mine += n
		}
	}
	return mine, all
}

// checkBudget refuses need more bytes of state in mem for the session when
// they are host memory and would pass MaxSessionStateBytes or MaxStateBytes
// (a device's memory is its allocator's to refuse).
func (s *Server) checkBudget(ss *session, mem backend.Memory, need int64, what string) error {
	if mem != backend.Host || need <= 0 || (s.MaxStateBytes <= 0 && s.MaxSessionStateBytes <= 0) {
		return nil
	}
	mine, all := s.hostStateBytes(ss)
	if lim := s.MaxSessionStateBytes; lim > 0 && need > lim-mine {
		return fmt.Errorf("over the memory budget: %s need %s, this session holds %s of its %s (--max-session-state-bytes)",
			what, FormatBytes(need), FormatBytes(mine), FormatBytes(lim))
	}
	if lim := s.MaxStateBytes; lim > 0 && need > lim-all {
		return fmt.Errorf("over the memory budget: %s need %s, the server holds %s of its %s for all sessions (--max-state-bytes)",
			what, FormatBytes(need), FormatBytes(all), FormatBytes(lim))
	}
	return nil
}

// FormatBytes writes n in binary units ("1.5 GiB").
func FormatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	f, i := float64(n), 0
	for f >= unit && i < 6 {
		f /= unit
		i++
	}
	return fmt.Sprintf("%.1f %ciB", f, "KMGTPE"[i-1])
}

func (s *Server) recordLatency(us int64) {
	if len(s.stepMicros) < cap(s.stepMicros) {
		s.stepMicros = append(s.stepMicros, us)
	} else {
		s.stepMicros[s.stepMicrosN%len(s.stepMicros)] = us
	}
	s.stepMicrosN++
}

// transfer is export (out) or import of a tensor's state through references
// of the session: all distinct from each other and from the parameter.
// Accumulated gradients are not state: both leave them pending, and an import
// sets the state their step starts from (as torch's load_state_dict or a
// script's edit between micro-batches does). A damaged tensor's partial sum
// cannot be trusted, so an import into it is refused while one waits.
func (s *Server) transfer(ss *session, x ipc.StateXfer, out bool) (any, error) {
	t := ss.tensors[x.Tensor]
	if t == nil {
		return nil, fmt.Errorf("unknown tensor %d", x.Tensor)
	}
	if n := t.state.Pending(); n > 0 && !out && t.state.Damage() != nil {
		return nil, fmt.Errorf("tensor %s is damaged and has %d accumulated gradients not yet applied, partly summed", t.name, n)
	}
	if !out && x.Step < 0 {
		return nil, fmt.Errorf("tensor %q: negative step %d", t.name, x.Step)
	}
	if err := t.state.Damage(); err != nil && out {
		return nil, fmt.Errorf("export refused, the tensor is damaged: %w", err)
	}
	refs := []ipc.MemRef{x.ExpAvg, x.ExpAvgSq}
	if t.hyper.Amsgrad {
		refs = append(refs, x.MaxExpAvgSq)
	}
	mem := make([]backend.Ref, len(refs))
	v := verifier{}
	for i, r := range refs {
		m, err := ss.resolveFor(t, r, v)
		if err != nil {
			return nil, fmt.Errorf("tensor %s state part %d: %w", t.name, i, err)
		}
		for j := 0; j < i; j++ {
			if m.Overlaps(mem[j]) {
				return nil, fmt.Errorf("tensor %s state parts %d and %d overlap", t.name, j, i)
			}
		}
		mem[i] = m
	}
	bs, err := s.backendSession(ss, t.seg.backend)
	if err != nil {
		return nil, err
	}
	if out {
		err = bs.Export(t.state, mem)
	} else {
		err = bs.Import(t.state, x.Step, mem)
	}
	if err != nil {
		return nil, err
	}
	return ipc.ExportReply{Step: t.state.Step(), Amsgrad: t.hyper.Amsgrad}, nil
}

// discard drops the accumulated gradients (micro-batches of step items
// that did not apply) of the request's tensors, as torch's zero_grad drops
// .grad: a client abandoned the step they were for. Their parameters,
// optimizer state and step counts stay as they are. Every tensor is checked
// first (ipc.Discard.Validate refused an empty list and duplicates); the
// drops touch no client memory and cannot fail, so the request does all or
// nothing. A damaged tensor is accepted: its partial sum was dropped when
// the fault marked it, and when that sum was all the fault spoiled (an
// interrupted accumulation) the mark is cleared, the tensor usable again
// without an import; the mark of an interrupted apply or import stays
// (optimizer.Tensor.Discard). Requests of a session run one at a time in
// arrival order (Handle holds s.mu; the transports keep each client's
// order), so a discard drops exactly the micro-batches sent before it.
func (s *Server) discard(ss *session, d ipc.Discard) (any, error) {
	type drop struct {
		t  *tensor
		bs backend.Session
	}
	drops := make([]drop, 0, len(d.Tensors))
	for i, id := range d.Tensors {
		t := ss.tensors[id]
		if t == nil {
			return nil, fmt.Errorf("tensors[%d]: unknown tensor %d", i, id)
		}
		bs, err := s.backendSession(ss, t.seg.backend) // open: it created the tensor
		if err != nil {
			return nil, err
		}
		drops = append(drops, drop{t, bs})
	}
	var rep ipc.DiscardReply
	for _, dr := range drops {
		had, err := dr.bs.Discard(dr.t.state)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", dr.t.name, err)
		}
		if had {
			rep.Discarded++
		}
	}
	s.log.Debug("accumulated gradients discarded", zap.String("client", ss.client), zap.Int("tensors", len(drops)),
		zap.Int("discarded", rep.Discarded))
	return rep, nil
}

func (s *Server) detach(ss *session, d ipc.Detach) (any, error) {
	seg := ss.segments[d.Seg]
	if seg == nil {
		return nil, fmt.Errorf("unknown segment %d", d.Seg)
	}
	for _, t := range ss.tensors {
		if t.seg == seg {
			return nil, fmt.Errorf("segment %d holds tensor %s: cannot detach", d.Seg, t.name)
		}
	}
	for _, t := range ss.staged {
		if t.seg == seg {
			return nil, fmt.Errorf("segment %d holds tensor %s, staged for registration: cannot detach", d.Seg, t.name)
		}
	}
	delete(ss.segments, d.Seg)
	if err := seg.seg.Close(); err != nil {
		return nil, err
	}
	return ipc.DetachReply{Seg: d.Seg}, nil
}

// Stats returns the server's counters.
func (s *Server) Stats() ipc.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats()
}

// usage is what a session holds in one backend, or in one kind of memory.
type usage struct {
	mem                  backend.Memory
	tensors, segments    int
	stateBytes, segBytes int64
}

func (u *usage) add(o *usage) {
	u.tensors += o.tensors
	u.segments += o.segments
	u.stateBytes += o.stateBytes
	u.segBytes += o.segBytes
}

// usage is what the session holds, by backend name.
func (ss *session) usage() map[string]*usage {
	u := map[string]*usage{}
	get := func(b string, mem backend.Memory) *usage {
		if u[b] == nil {
			u[b] = &usage{mem: mem}
		}
		return u[b]
	}
	for _, t := range ss.tensors {
		x := get(t.seg.backend, t.seg.mem)
		x.tensors++
		x.stateBytes += t.state.StateBytes()
	}
	for _, seg := range ss.segments {
		x := get(seg.backend, seg.mem)
		x.segments++
		x.segBytes += seg.seg.Size()
	}
	return u
}

// held is what the session holds, by where it lies.
func (ss *session) held() (by [backend.Device + 1]usage) {
	for _, u := range ss.usage() {
		by[u.mem].add(u)
	}
	return by
}

func (s *Server) stats() ipc.Stats {
	st := ipc.Stats{Requests: s.requests, Errors: s.errors, StepItems: s.stepItems, BytesUpdated: s.bytesUpdated,
		Sessions: len(s.sessions), ByOp: map[string]int64{}}
	for k, v := range s.byOp {
		st.ByOp[k] = v
	}
	for _, ss := range s.sessions {
		// Host memory (shared-memory segments, state in the server's heap)
		// and device memory are reported apart.
		by := ss.held()
		host, dev := by[backend.Host], by[backend.Device]
		st.Tensors += host.tensors + dev.tensors
		st.StateBytes += host.stateBytes
		st.Segments += host.segments
		st.SegmentBytes += host.segBytes
		st.DeviceStateBytes += dev.stateBytes
		st.DeviceSegments += dev.segments
	}
	for _, b := range s.backends {
		bst := b.Stats()
		st.IPCOpen += bst.IPCOpen
		st.IPCOpenBytes += bst.IPCOpenBytes
		st.IPCOpens += bst.IPCOpens
		st.CheckSeconds += bst.CheckSeconds
		st.ReadSeconds += bst.ReadSeconds
		st.KernelSeconds += bst.KernelSeconds
	}
	if n := len(s.stepMicros); n > 0 {
		l := append([]int64(nil), s.stepMicros...)
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		st.StepMicrosP50 = l[n/2]
		st.StepMicrosP99 = l[(n*99)/100]
		st.StepMicrosMax = l[n-1]
	}
	return st
}

// release frees a client's tensors and closes its segments, in every backend.
func (s *Server) release(client string) {
	ss := s.sessions[client]
	if ss == nil {
		return
	}
	var errs []error
	for _, seg := range ss.segments {
		errs = append(errs, seg.seg.Close())
	}
	for name, bs := range ss.open {
		if err := bs.Close(); err != nil {
			errs = append(errs, fmt.Errorf("%s backend: %w", name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		s.log.Warn("releasing session", zap.String("client", client), zap.Error(err))
	}
	delete(s.sessions, client)
	s.forgetMetrics(client)
	s.log.Info("client released", zap.String("client", client), zap.Int("tensors", len(ss.tensors)), zap.Int("segments", len(ss.segments)))
}

// Close releases every session, then the backends.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.sessions {
		s.release(c)
	}
	for name, b := range s.backends {
		if err := b.Close(); err != nil {
			s.log.Warn("closing backend", zap.String("backend", name), zap.Error(err))
		}
	}
	s.backends = map[string]backend.Backend{}
}
