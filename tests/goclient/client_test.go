// Package goclient is the Go end-to-end test of sonard: a minimal client of
// its protocol
// (docs/protocol.md): a ZeroMQ DEALER socket that sends the ipc package's
// msgpack requests one at a time and waits for each reply, and POSIX
// shared-memory segments created as the server accepts them
// (/dev/shm/sonar-*, mode 0600), driving a real sonard process built with
// scripts/build-go. It checks that sonard and the engine in-process compute
// the same updates; the Python package sonar_moe is the full client
// (pipelining, slot rings, state dicts).
package goclient

import (
	"errors"
	"fmt"
	"os"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/vmihailenco/msgpack/v5"
)

// Client is one session with a sonard.
type Client struct {
	sock *zmq.Socket
	addr string
	id   uint64
}

// reply is ipc.Reply with the body kept raw for a second decoding stage.
type reply struct {
	V     int                `msgpack:"v"`
	ID    uint64             `msgpack:"id"`
	OK    bool               `msgpack:"ok"`
	Error string             `msgpack:"error"`
	Body  msgpack.RawMessage `msgpack:"body"`
}

// ErrServer is wrapped by the errors of requests the server refused.
var ErrServer = errors.New("sonard refused the request")

// Dial connects to a sonard at addr ("ipc:///path" or "tcp://host:port").
// Each call waits at most timeout for its reply.
func Dial(addr string, timeout time.Duration) (*Client, error) {
	s, err := zmq.NewSocket(zmq.DEALER)
	if err != nil {
		return nil, fmt.Errorf("goclient: zmq socket: %w", err)
	}
	for _, set := range []func() error{
		func() error { return s.SetLinger(0) },
		func() error { return s.SetRcvtimeo(timeout) },
		func() error { return s.SetSndtimeo(timeout) },
		func() error { return s.Connect(addr) },
	} {
		if err := set(); err != nil {
			s.Close()
			return nil, fmt.Errorf("goclient: connect %s: %w", addr, err)
		}
	}
	return &Client{sock: s, addr: addr}, nil
}

// SetTimeout changes how long each call waits to send and for its reply.
func (c *Client) SetTimeout(d time.Duration) error {
	if err := c.sock.SetRcvtimeo(d); err != nil {
		return fmt.Errorf("goclient: set timeout: %w", err)
	}
	if err := c.sock.SetSndtimeo(d); err != nil {
		return fmt.Errorf("goclient: set timeout: %w", err)
	}
	return nil
}

// Close closes the socket (the server keeps the session until Bye or its
// own shutdown).
func (c *Client) Close() error {
	if err := c.sock.Close(); err != nil {
		return fmt.Errorf("goclient: close: %w", err)
	}
	return nil
}

// Call sends op with body (nil: an empty map) and decodes the reply's body
// into out (nil: ignored).
func (c *Client) Call(op string, body, out any) error {
	if body == nil {
		body = map[string]any{}
	}
	enc, err := msgpack.Marshal(body)
	if err != nil {
		return fmt.Errorf("goclient: %s: encode body: %w", op, err)
	}
	c.id++
	req, err := msgpack.Marshal(&ipc.Request{V: ipc.Version, Op: op, ID: c.id, Body: enc})
	if err != nil {
		return fmt.Errorf("goclient: %s: encode request: %w", op, err)
	}
	if _, err := c.sock.SendBytes(req, 0); err != nil {
		return fmt.Errorf("goclient: %s: send to %s: %w", op, c.addr, err)
	}
	frames, err := c.sock.RecvMessageBytes(0)
	if err != nil {
		return fmt.Errorf("goclient: %s: no reply from %s: %w", op, c.addr, err)
	}
	var r reply
	if err := msgpack.Unmarshal(frames[len(frames)-1], &r); err != nil {
		return fmt.Errorf("goclient: %s: malformed reply: %w", op, err)
	}
	switch {
	case r.ID != c.id:
		return fmt.Errorf("goclient: %s: reply to request %d, want %d", op, r.ID, c.id)
	case !r.OK:
		return fmt.Errorf("goclient: %w: %s", ErrServer, r.Error)
	case out != nil:
		if err := msgpack.Unmarshal(r.Body, out); err != nil {
			return fmt.Errorf("goclient: %s: malformed reply body: %w", op, err)
		}
	}
	return nil
}

// Hello opens the session and returns the server's description.
func (c *Client) Hello() (ipc.HelloReply, error) {
	var r ipc.HelloReply
	err := c.Call(ipc.OpHello, ipc.Hello{Client: "goclient (Go test)", PID: os.Getpid()}, &r)
	return r, err
}

// Attach maps seg into the server (which unlinks its name) and returns the
// segment id for MemRefs.
func (c *Client) Attach(seg *Segment) (uint32, error) {
	var r ipc.AttachReply
	err := c.Call(ipc.OpAttach, ipc.Attach{Shm: seg.Name(), Size: int64(len(seg.Bytes()))}, &r)
	return r.Seg, err
}

// Register registers tensors and returns their ids in order.
func (c *Client) Register(tensors []ipc.TensorSpec) ([]uint32, error) {
	var r ipc.RegisterReply
	err := c.Call(ipc.OpRegister, ipc.Register{Tensors: tensors}, &r)
	return r.IDs, err
}

// Step sends one group of gradients and waits until they are applied or
// accumulated (then their memory may be reused).
func (c *Client) Step(items []ipc.StepItem) (ipc.StepReply, error) {
	var r ipc.StepReply
	err := c.Call(ipc.OpStep, ipc.Step{Items: items}, &r)
	return r, err
}

// Export copies a tensor's optimizer state into shared memory.
func (c *Client) Export(x ipc.StateXfer) (ipc.ExportReply, error) {
	var r ipc.ExportReply
	err := c.Call(ipc.OpExport, x, &r)
	return r, err
}

// Stats returns the server's counters.
func (c *Client) Stats() (ipc.Stats, error) {
	var r ipc.Stats
	err := c.Call(ipc.OpStats, nil, &r)
	return r, err
}

// Bye releases the session on the server.
func (c *Client) Bye() error { return c.Call(ipc.OpBye, nil, nil) }

// Shutdown releases the session and stops the server. The reply can be
// lost when the server closes its socket right after queueing it; callers
// that must know the server stopped should wait for its process.
// Shutdown stops the server; token is its --admin-token-file's secret.
func (c *Client) Shutdown(token string) error {
	return c.Call(ipc.OpShutdown, ipc.Shutdown{Token: token}, nil)
}

// HyperMsg converts hyper-parameters to their wire form.
func HyperMsg(h optimizer.Hyper) ipc.HyperMsg {
	return ipc.HyperMsg{LR: h.LR, Beta1: h.Beta1, Beta2: h.Beta2, Eps: h.Eps, WeightDecay: h.WeightDecay,
		Amsgrad: h.Amsgrad, Maximize: h.Maximize}
}

// ScalarsMsg converts one step's scalars to their wire form.
func ScalarsMsg(s optimizer.Scalars) ipc.ScalarsMsg {
	return ipc.ScalarsMsg{Decay: s.Decay, ApplyDecay: s.ApplyDecay, Beta1W: s.Beta1W, Beta2: s.Beta2,
		OneMinusB2: s.OneMinusB2, NegStepSize: s.NegStepSize, BC2Sqrt: s.BC2Sqrt, Eps: s.Eps,
		Amsgrad: s.Amsgrad, Maximize: s.Maximize}
}
