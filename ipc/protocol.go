// Package ipc owns the wire protocol between the Python client and sonard:
// msgpack-encoded messages (a versioned envelope around one body per
// operation), their validation, and the transports that carry them: a
// ZeroMQ ROUTER (ipc://, tcp://) and sonard's own Unix stream socket
// (unix://), chosen once from the address (Open). docs/protocol.md is the
// human-readable specification.
package ipc

import (
	"errors"
	"fmt"
	"math"
	"reflect"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"
)

// Version is the protocol version carried in every message. A server
// answers a message of another version with an error reply.
const Version = 1

// Operations.
const (
	OpHello    = "hello"
	OpAttach   = "attach"
	OpRegister = "register"
	OpStep     = "step"
	OpExport   = "export"
	OpImport   = "import"
	OpDetach   = "detach"
	OpStats    = "stats"
	OpPing     = "ping" // no body -> no body: a bare round trip (liveness, latency)
	OpBye      = "bye"
	OpShutdown = "shutdown"
	// CUDA path (optional: a server without CUDA answers them with an
	// error; older peers never send them, so the version stays 1).
	OpAttachCUDA = "attach_cuda" // AttachCUDA -> AttachReply
	OpCUDAEvent  = "cuda_event"  // CUDAEvent -> {}
	// The client's own memory as a segment of gradients (optional: a
	// client falls back to shared memory when it is refused).
	OpAttachProcess = "attach_process" // AttachProcess -> AttachReply
	// Dropping accumulated micro-batch gradients (optional: an older
	// server answers it "unknown op"; HelloReply.Features names
	// FeatureDiscard where it is served).
	OpDiscard = "discard" // Discard -> DiscardReply
)

// Limits on what one message may ask for.
const (
	MaxMessageBytes = 4 << 20 // one message (bodies carry references, not data)
	MaxItems        = 4096    // tensors in one register or step
	// MaxStaged bounds the tensors one session stages with Register.More
	// (their names and shapes wait in the server's memory).
	MaxStaged  = 1 << 18
	MaxDims    = 8
	MaxNameLen = 512
	// MaxErrorBytes bounds the text of an error reply (the values it quotes
	// are clipped first, package clip).
	MaxErrorBytes = 4096
)

// Request is the envelope of every client message.
type Request struct {
	V    int                `msgpack:"v"`
	Op   string             `msgpack:"op"`
	ID   uint64             `msgpack:"id"`
	Body msgpack.RawMessage `msgpack:"body"`
}

// Reply is the envelope of every server message. OK false carries Error; the
// server did nothing for that request.
type Reply struct {
	V     int    `msgpack:"v"`
	ID    uint64 `msgpack:"id"`
	OK    bool   `msgpack:"ok"`
	Error string `msgpack:"error,omitempty"`
	Body  any    `msgpack:"body,omitempty"`
	// Times are the server's CLOCK_MONOTONIC readings, in nanoseconds, when
	// the request had been received, decoded and handled (the reply is
	// encoded and sent right after): a client on the same machine reads the
	// same clock and can tell where a round trip's time went.
	Times []int64 `msgpack:"t,omitempty"`
}

// Monotonic is CLOCK_MONOTONIC in nanoseconds, the clock of Reply.Times
// (Python's time.monotonic_ns on Linux).
func Monotonic() int64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return 0
	}
	return ts.Nano()
}

// MemRef names bytes [Offset, Offset+Bytes) of an attached segment.
type MemRef struct {
	Seg    uint32 `msgpack:"seg"`
	Offset int64  `msgpack:"off"`
	Bytes  int64  `msgpack:"nbytes"`
}

// Hello opens a session.
type Hello struct {
	Client     string `msgpack:"client"`
	PID        int    `msgpack:"pid"`
	Torch      string `msgpack:"torch"`
	Threads    int    `msgpack:"threads"`
	Capability string `msgpack:"capability"`
	// SqrtLib is the library whose vmsSqrt the client's torch uses for
	// float32 sqrt (its libtorch_cpu.so), "" when that sqrt is IEEE. The
	// server loads it for this session; only local (ipc://) clients may
	// name one.
	SqrtLib string `msgpack:"sqrt_lib,omitempty"`
}

// HelloReply answers Hello.
type HelloReply struct {
	Server   string `msgpack:"server"`
	Protocol int    `msgpack:"protocol"`
	PID      int    `msgpack:"pid"`
	Workers  int    `msgpack:"workers"`
	Sqrt     string `msgpack:"sqrt"` // this session's: "ieee" or "mkl:<library>"
	// ISA is the vector instruction set of the CPU update kernels:
	// "avx512vbmi", "avx512bf16", "avx512", "avx2" or "go" (bitwise alike; a matter of
	// speed only).
	ISA string `msgpack:"isa,omitempty"`
	// CUDA describes the server's GPU ("NVIDIA H200, cc 9.0, compute_90, scalar loads"),
	// empty when the server has no CUDA path.
	CUDA string `msgpack:"cuda,omitempty"`
	// ReconnectGraceMillis is how long the server keeps a session after its
	// connection closed, for the client to reconnect with the same routing id.
	ReconnectGraceMillis int64 `msgpack:"reconnect_grace_ms,omitempty"`
	// Features names the optional parts of the protocol this server
	// implements (FeatureGradScale), so a client can refuse to run an option
	// an older server would ignore.
	Features []string `msgpack:"features,omitempty"`
}

// Attach asks the server to map a shared-memory segment the client created.
type Attach struct {
	Shm  string `msgpack:"shm"`
	Size int64  `msgpack:"size"`
}

// AttachProcess asks the server to read gradients where they lie in the
// client's own memory (process_vm_readv): the probe's bytes are at
// ProbeAddr in the client. The server takes the client's process id from
// the connection (SO_PEERCRED on ipc://), never from the message.
type AttachProcess struct {
	ProbeAddr uint64 `msgpack:"probe_addr"`
	Probe     []byte `msgpack:"probe"`
}

// AttachCUDA asks the server to open a client's CUDA allocation by its IPC
// handle: torch's UntypedStorage._share_cuda_()[1] (66 bytes) or a raw
// 64-byte cudaIpcMemHandle_t. Size > 0 is the number of bytes the client
// uses from the allocation's start (0: not checked).
type AttachCUDA struct {
	Handle []byte `msgpack:"handle"`
	Size   int64  `msgpack:"size"`
}

// CUDAEvent hands the server the session's interprocess event
// (torch.cuda.Event(interprocess=True).ipc_handle(), 64 bytes); a Step with
// WaitEvent orders its kernels after the event's latest record.
type CUDAEvent struct {
	Handle []byte `msgpack:"handle"`
}

// AttachReply gives the segment's id for MemRefs.
type AttachReply struct {
	Seg uint32 `msgpack:"seg"`
}

// HyperMsg are AdamW hyper-parameters at registration.
type HyperMsg struct {
	LR          float64 `msgpack:"lr"`
	Beta1       float64 `msgpack:"beta1"`
	Beta2       float64 `msgpack:"beta2"`
	Eps         float64 `msgpack:"eps"`
	WeightDecay float64 `msgpack:"weight_decay"`
	Amsgrad     bool    `msgpack:"amsgrad"`
	Maximize    bool    `msgpack:"maximize"`
}

// TensorSpec describes one tensor to register.
type TensorSpec struct {
	Name  string   `msgpack:"name"`
	Shape []int64  `msgpack:"shape"`
	DType string   `msgpack:"dtype"`
	Param MemRef   `msgpack:"param"`
	Hyper HyperMsg `msgpack:"hyper"`
}

// Register registers tensors; all or none.
type Register struct {
	Tensors []TensorSpec `msgpack:"tensors"`
	// More stages the tensors for a later register of the same session
	// instead of registering them: a model with more than MaxItems expert
	// tensors is registered in several requests, all or none. The first
	// request without More registers what was staged and its own tensors
	// together (its reply gives the ids of all, staged first, in order);
	// an error in any of them drops everything staged. Named in
	// HelloReply.Features as FeatureRegisterMore.
	More bool `msgpack:"more,omitempty"`
}

// RegisterReply gives tensor ids, in request order (none for a request with
// More: its tensors get theirs from the request that registers them).
type RegisterReply struct {
	IDs []uint32 `msgpack:"ids"`
}

// ScalarsMsg are one step's constants, computed by the client as torch does.
type ScalarsMsg struct {
	Decay       float64 `msgpack:"decay"`
	ApplyDecay  bool    `msgpack:"apply_decay"`
	Beta1W      float64 `msgpack:"beta1_w"`
	Beta2       float64 `msgpack:"beta2"`
	OneMinusB2  float64 `msgpack:"one_minus_beta2"`
	NegStepSize float64 `msgpack:"neg_step_size"`
	BC2Sqrt     float64 `msgpack:"bc2_sqrt"`
	Eps         float64 `msgpack:"eps"`
	Amsgrad     bool    `msgpack:"amsgrad"`
	Maximize    bool    `msgpack:"maximize"`
	// Fused asks for torch's fused CPU arithmetic (AdamW(fused=True));
	// Lanes is the vector width of the client's fused kernel for the dtype
	// (8 or 16 lanes of an AVX2/AVX-512 build, 0 for a build without them).
	Fused bool `msgpack:"fused,omitempty"`
	Lanes int  `msgpack:"lanes,omitempty"`
	// LR, Beta1 and WeightDecay are the group's hyper-parameters as the
	// client's torch passes them to its fused CUDA kernel; sent with Fused
	// (the CUDA backend's fused kernels need them, the CPU one ignores them).
	LR          float64 `msgpack:"lr,omitempty"`
	Beta1       float64 `msgpack:"beta1,omitempty"`
	WeightDecay float64 `msgpack:"weight_decay,omitempty"`
	// FusedDouble (with Fused, CUDA): the client's torch is 2.8 to 2.10,
	// whose fused CUDA kernel computes partly in double.
	FusedDouble bool `msgpack:"fused_double,omitempty"`
}

// StepItem is one tensor's gradient. Apply false accumulates it (a
// micro-batch of gradient accumulation); Apply true adds it to what was
// accumulated and runs AdamW. Grad may be absent (Seg 0) with Apply true to
// apply what was accumulated. Step is the tensor's step count after this
// update as the client counts it (checked when Apply is set).
type StepItem struct {
	Tensor  uint32     `msgpack:"tensor"`
	Grad    MemRef     `msgpack:"grad"`
	Apply   bool       `msgpack:"apply"`
	Step    int64      `msgpack:"step"`
	Scalars ScalarsMsg `msgpack:"scalars"`
	// GradScale (with Apply, CPU tensors) multiplies the gradient being
	// applied (the accumulated sum with accumulation), rounded to float32,
	// before the AdamW arithmetic, as grad.mul_(scale) does in torch: the
	// client's expert clipping. 0 (absent) leaves the gradient as it is.
	GradScale float64 `msgpack:"grad_scale,omitempty"`
}

// Step carries the gradients of one group of tensors (a layer's experts).
type Step struct {
	Items []StepItem `msgpack:"items"`
	// WaitEvent (CUDA tensors only) makes the server's kernels wait for the
	// latest record of the session's event (CUDAEvent) before they start.
	WaitEvent bool `msgpack:"wait_event,omitempty"`
	// Norms asks for the squared L2 norm of each applied gradient (before
	// GradScale), in the reply's SqNorms.
	Norms bool `msgpack:"norms,omitempty"`
}

// StepReply says the gradients' memory may be reused.
type StepReply struct {
	Applied     int   `msgpack:"applied"`
	Accumulated int   `msgpack:"accumulated"`
	Bytes       int64 `msgpack:"bytes"`
	Micros      int64 `msgpack:"micros"`
	// SqNorms (when the request set Norms) has one entry per item, in
	// request order: the squared L2 norm of the gradient it applied, summed
	// in float64; 0 for an item that only accumulated.
	SqNorms []float64 `msgpack:"sq_norms,omitempty"`
}

// FeatureGradScale is named in HelloReply.Features by a server that
// implements StepItem.GradScale and Step.Norms.
const FeatureGradScale = "grad_scale"

// FeatureDiscard is named in HelloReply.Features by a server that serves
// OpDiscard.
const FeatureDiscard = "discard"

// FeatureRegisterMore is named in HelloReply.Features by a server that
// stages Register requests with More.
const FeatureRegisterMore = "register_more"

// Discard drops the gradients accumulated (Step items with Apply false) and
// not yet applied of some tensors of the session, as torch's zero_grad drops
// .grad; their optimizer state and step count stay as they are.
type Discard struct {
	Tensors []uint32 `msgpack:"tensors"`
}

// DiscardReply says how many of the tensors had something pending.
type DiscardReply struct {
	Discarded int `msgpack:"discarded"`
}

// StateXfer moves one tensor's optimizer state through shared memory, in
// the tensor's dtype: export copies the server's state into the referenced
// memory (and returns the step in the reply), import copies it from there.
// MaxExpAvgSq is used with amsgrad only (Seg 0 otherwise).
type StateXfer struct {
	Tensor      uint32 `msgpack:"tensor"`
	Step        int64  `msgpack:"step"`
	ExpAvg      MemRef `msgpack:"exp_avg"`
	ExpAvgSq    MemRef `msgpack:"exp_avg_sq"`
	MaxExpAvgSq MemRef `msgpack:"max_exp_avg_sq"`
}

// ExportReply answers an export.
type ExportReply struct {
	Step    int64 `msgpack:"step"`
	Amsgrad bool  `msgpack:"amsgrad"`
}

// ByeReply answers bye.
type ByeReply struct {
	Bye bool `msgpack:"bye"`
}

// ShutdownReply answers shutdown.
type ShutdownReply struct {
	Shutdown bool `msgpack:"shutdown"`
}

// DetachReply answers detach with the segment detached.
type DetachReply struct {
	Seg uint32 `msgpack:"seg"`
}

// EventReply answers cuda_event.
type EventReply struct {
	Event bool `msgpack:"event"`
}

// Detach unmaps a segment the session attached.
type Detach struct {
	Seg uint32 `msgpack:"seg"`
}

// Stats are the server's counters.
type Stats struct {
	Requests      int64            `msgpack:"requests"`
	Errors        int64            `msgpack:"errors"`
	StepItems     int64            `msgpack:"step_items"`
	BytesUpdated  int64            `msgpack:"bytes_updated"`
	Tensors       int              `msgpack:"tensors"`
	StateBytes    int64            `msgpack:"state_bytes"`
	Segments      int              `msgpack:"segments"`
	SegmentBytes  int64            `msgpack:"segment_bytes"`
	Sessions      int              `msgpack:"sessions"`
	StepMicrosP50 int64            `msgpack:"step_us_p50"`
	StepMicrosP99 int64            `msgpack:"step_us_p99"`
	StepMicrosMax int64            `msgpack:"step_us_max"`
	ByOp          map[string]int64 `msgpack:"by_op"`
	// CUDA path (zero without it): optimizer state in device memory,
	// attached CUDA allocations, and the IPC cache's open allocations.
	DeviceStateBytes int64 `msgpack:"device_state_bytes,omitempty"`
	DeviceSegments   int   `msgpack:"device_segments,omitempty"`
	IPCOpen          int   `msgpack:"ipc_open,omitempty"`
	IPCOpenBytes     int64 `msgpack:"ipc_open_bytes,omitempty"`
	IPCOpens         int64 `msgpack:"ipc_opens,omitempty"`
	// CPU path, since start: seconds (added over the workers) spent
	// checking that client gradient pages are readable, copying gradients
	// out of client processes, and in the AdamW arithmetic.
	CheckSeconds  float64 `msgpack:"check_s"`
	ReadSeconds   float64 `msgpack:"read_s"`
	KernelSeconds float64 `msgpack:"kernel_s"`
}

// ErrProtocol marks malformed or unsupported messages.
var ErrProtocol = errors.New("protocol error")

// DecodeRequest decodes and checks the envelope. On error the returned
// request may still carry the id, so the reply can name it.
func DecodeRequest(b []byte) (Request, error) {
	var r Request
	if len(b) > MaxMessageBytes {
		return r, fmt.Errorf("%w: message of %d bytes exceeds %d", ErrProtocol, len(b), MaxMessageBytes)
	}
	if err := CheckMsgpack(b); err != nil {
		return Request{}, fmt.Errorf("%w: malformed msgpack: %v", ErrProtocol, err)
	}
	if err := CheckIntRanges(b, reflect.TypeOf(r)); err != nil {
		return Request{}, fmt.Errorf("%w: envelope: %v", ErrProtocol, err)
	}
	if err := msgpack.Unmarshal(b, &r); err != nil {
		return Request{}, fmt.Errorf("%w: malformed msgpack envelope: %v", ErrProtocol, err)
	}
	if r.V != Version {
		return r, fmt.Errorf("%w: unsupported protocol version %d (server speaks %d)", ErrProtocol, r.V, Version)
	}
	if r.Op == "" {
		return r, fmt.Errorf("%w: missing op", ErrProtocol)
	}
	return r, nil
}

// DecodeBody decodes the request's body into v and validates it when v has
// a Validate method.
func DecodeBody(r Request, v any) error {
	if len(r.Body) == 0 {
		return fmt.Errorf("%w: %s: missing body", ErrProtocol, r.Op)
	}
	if err := CheckIntRanges(r.Body, reflect.TypeOf(v)); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrProtocol, r.Op, err)
	}
	if err := msgpack.Unmarshal(r.Body, v); err != nil {
		return fmt.Errorf("%w: %s: malformed body: %v", ErrProtocol, r.Op, err)
	}
	if val, ok := v.(interface{ Validate() error }); ok {
		if err := val.Validate(); err != nil {
			return fmt.Errorf("%w: %s: %v", ErrProtocol, r.Op, err)
		}
	}
	return nil
}

// EncodeReply encodes a reply envelope.
func EncodeReply(r Reply) ([]byte, error) {
	r.V = Version
	b, err := msgpack.Marshal(&r)
	if err != nil {
		return nil, fmt.Errorf("encode reply %d: %w", r.ID, err)
	}
	return b, nil
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// Validate checks a Register body's shape (not memory: the server does that).
func (r *Register) Validate() error {
	if len(r.Tensors) == 0 || len(r.Tensors) > MaxItems {
		return fmt.Errorf("%d tensors (want 1..%d)", len(r.Tensors), MaxItems)
	}
	for i, t := range r.Tensors {
		if t.Name == "" || len(t.Name) > MaxNameLen {
			return fmt.Errorf("tensor %d: name length %d (want 1..%d)", i, len(t.Name), MaxNameLen)
		}
		if len(t.Shape) == 0 || len(t.Shape) > MaxDims {
			return fmt.Errorf("tensor %q: %d dims (want 1..%d)", t.Name, len(t.Shape), MaxDims)
		}
		n := int64(1)
		for _, d := range t.Shape {
			if d <= 0 || d > 1<<40 || n > (1<<40)/d {
				return fmt.Errorf("tensor %q: shape %v out of range", t.Name, t.Shape)
			}
			n *= d
		}
		for _, x := range []float64{t.Hyper.LR, t.Hyper.Beta1, t.Hyper.Beta2, t.Hyper.Eps, t.Hyper.WeightDecay} {
			if !finite(x) {
				return fmt.Errorf("tensor %q: non-finite hyper-parameter", t.Name)
			}
		}
	}
	return nil
}

// Numel is the product of the spec's shape (valid after Validate).
func (t TensorSpec) Numel() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Validate checks a Step body's shape.
func (s *Step) Validate() error {
	if len(s.Items) == 0 || len(s.Items) > MaxItems {
		return fmt.Errorf("%d items (want 1..%d)", len(s.Items), MaxItems)
	}
	seen := make(map[uint32]bool, len(s.Items))
	for i, it := range s.Items {
		if seen[it.Tensor] {
			return fmt.Errorf("item %d: tensor %d appears twice", i, it.Tensor)
		}
		seen[it.Tensor] = true
		if it.Grad.Seg == 0 && !it.Apply {
			return fmt.Errorf("item %d: no gradient and nothing to apply", i)
		}
		if it.GradScale != 0 && (!it.Apply || !finite(it.GradScale) || it.GradScale < 0 ||
			float32(it.GradScale) == 0 || math.IsInf(float64(float32(it.GradScale)), 0)) {
			return fmt.Errorf("item %d: grad_scale %g (want a positive finite float32, on an item that applies)", i, it.GradScale)
		}
		sc := it.Scalars
		if sc.Lanes < 0 || sc.Lanes > 64 || sc.Lanes&(sc.Lanes-1) != 0 || (sc.Lanes != 0 && !sc.Fused) {
			return fmt.Errorf("item %d: lanes %d (want 0, or a power of two up to 64 with fused)", i, sc.Lanes)
		}
		for _, x := range []float64{sc.Decay, sc.Beta1W, sc.Beta2, sc.OneMinusB2, sc.NegStepSize, sc.BC2Sqrt, sc.Eps,
			sc.LR, sc.Beta1, sc.WeightDecay} {
			if it.Apply && !finite(x) {
				return fmt.Errorf("item %d: non-finite scalar", i)
			}
		}
	}
	return nil
}

// Validate checks a Discard body's shape (the server checks that the
// tensors are the session's).
func (d *Discard) Validate() error {
	if len(d.Tensors) == 0 || len(d.Tensors) > MaxItems {
		return fmt.Errorf("%d tensors (want 1..%d)", len(d.Tensors), MaxItems)
	}
	seen := make(map[uint32]bool, len(d.Tensors))
	for i, id := range d.Tensors {
		if seen[id] {
			return fmt.Errorf("tensors[%d]: tensor %d appears twice", i, id)
		}
		seen[id] = true
	}
	return nil
}

// Validate checks an Attach body.
func (a *Attach) Validate() error {
	if a.Shm == "" || a.Size <= 0 {
		return fmt.Errorf("attach needs a name and a positive size")
	}
	return nil
}

// Validate checks an AttachProcess body.
func (a *AttachProcess) Validate() error {
	if len(a.Probe) < 16 || len(a.Probe) > 4096 {
		return fmt.Errorf("probe of %d bytes (want 16..4096)", len(a.Probe))
	}
	if a.ProbeAddr == 0 {
		return errors.New("probe address 0")
	}
	return nil
}

// Validate checks an AttachCUDA body (the handle's format is checked by the
// server's CUDA mapper).
func (a *AttachCUDA) Validate() error {
	if len(a.Handle) != 64 && len(a.Handle) != 66 {
		return fmt.Errorf("handle of %d bytes (want 64 raw bytes, or 66 from torch)", len(a.Handle))
	}
	if a.Size < 0 {
		return fmt.Errorf("negative size %d", a.Size)
	}
	return nil
}

// Validate checks a CUDAEvent body.
func (e *CUDAEvent) Validate() error {
	if len(e.Handle) != 64 {
		return fmt.Errorf("event handle of %d bytes (want 64)", len(e.Handle))
	}
	return nil
}
