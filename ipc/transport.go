package ipc

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/sonar-moe/sonar/internal/clip"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Handler serves one decoded request of one client (identified by its
// ZeroMQ routing id) and returns the reply body or an error. Handle is only
// ever called from the transport's goroutine.
type Handler interface {
	Handle(client string, req Request) (any, error)
}

// Ticker is implemented by handlers that want to run housekeeping (such as
// releasing the sessions of dead clients) about once a second, on the
// transport's goroutine.
type Ticker interface {
	Tick(now time.Time)
}

// Watcher is implemented by handlers that tie a client's state to its
// connection. On the transport's goroutine, Connected is called before the
// first request of a client on a connection the transport watches, and
// Disconnected when that connection closed (the process exited or closed its
// socket, or it missed the heartbeats).
type Watcher interface {
	Connected(client string)
	Disconnected(client string)
}

// Transport is a ZeroMQ ROUTER socket serving a Handler. Clients use DEALER
// sockets (requests may be pipelined) and send one frame per message.
type Transport struct {
	sock *zmq.Socket
	mon  *zmq.Socket // PAIR end of the ROUTER's monitor: connections accepted and closed
	// ctx is the sockets' own ZeroMQ context (nil with CURVE: authentication runs in the
	// default context). Close terminates it, which is what makes the linger wait happen:
	// closing the socket alone hands queued replies (a shutdown's answer) to ZeroMQ's
	// threads, which the process's exit can end before they are sent.
	ctx  *zmq.Context
	log  *zap.Logger
	addr string
	// ipcPath is the socket file of an ipc:// endpoint, removed on Close.
	ipcPath string
	conns   *conns
	out     map[string]*outbox // clients whose replies or requests wait
	stale   int64              // requests dropped: their connection had closed
	// maxConns is Options.MaxConns; refused counts the connections closed
	// past it, logged at most once a second (refusedLog).
	maxConns   int
	refused    int64
	refusedLog time.Time
}

// Options are the transport's tunables (zero values: the defaults).
type Options struct {
	// HeartbeatInterval is how often the server pings each connection
	// (ZMQ_HEARTBEAT_IVL, default 1 s); HeartbeatTimeout closes a connection
	// that answered nothing for that long (default 10 s), which releases its
	// client's session like a closed socket.
	HeartbeatInterval, HeartbeatTimeout time.Duration
	// Poll is how long a unix:// connection polls its socket for the next
	// request before it sleeps, while requests come in quick succession
	// (pollRule); 0: never. The ZeroMQ transport does not poll (its I/O
	// threads, not the serving goroutine, wait for the socket).
	Poll time.Duration
	// MaxConns bounds the client connections open at once (0: no bound):
	// a connection accepted past it is closed at once, logged.
	MaxConns int
}

func (o Options) withDefaults() Options {
	if o.HeartbeatInterval <= 0 {
		o.HeartbeatInterval = time.Second
	}
	if o.HeartbeatTimeout <= 0 {
		o.HeartbeatTimeout = 10 * time.Second
	}
	return o
}

// Curve configures ZeroMQ CURVE authentication and encryption: the server's
// secret key and the public keys of the clients allowed to connect (Z85).
type Curve struct {
	ServerSecret string
	ClientKeys   []string
}

// Listen binds a ROUTER socket to addr, which must pass CheckEndpoint:
// "ipc:///path" (the socket file is created with mode 0600 in a private
// directory) or "tcp://host:port" with curve (only clients holding an
// allowed key can connect).
func Listen(addr string, log *zap.Logger, curve *Curve, opts ...Options) (*Transport, error) {
	hasCurve := curve != nil && curve.ServerSecret != "" && len(curve.ClientKeys) > 0
	if err := CheckEndpoint(addr, hasCurve); err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	o := Options{}
	if len(opts) > 0 {
		o = opts[0]
	}
	o = o.withDefaults()
	var ctx *zmq.Context
	var sock *zmq.Socket
	var err error
	if hasCurve {
		sock, err = zmq.NewSocket(zmq.ROUTER)
	} else if ctx, err = zmq.NewContext(); err == nil {
		if sock, err = ctx.NewSocket(zmq.ROUTER); err != nil {
			_ = ctx.Term()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("zmq socket: %w", err)
	}
	if hasCurve {
		zmq.AuthSetVerbose(false)
		if err := zmq.AuthStart(); err != nil {
			sock.Close()
			return nil, fmt.Errorf("zmq auth: %w", err)
		}
		zmq.AuthCurveAdd("sonar", curve.ClientKeys...)
		if err := sock.ServerAuthCurve("sonar", curve.ServerSecret); err != nil {
			sock.Close()
			return nil, fmt.Errorf("zmq curve: %w", err)
		}
	}
	t := &Transport{sock: sock, ctx: ctx, log: log, addr: addr, conns: newConns(), out: map[string]*outbox{}, maxConns: o.MaxConns}
	if err := t.configure(o); err != nil {
		t.closeSockets()
		return nil, err
	}
	if p, ok := strings.CutPrefix(addr, "ipc://"); ok {
		t.ipcPath = p
		if err := privateDir(filepath.Dir(p)); err != nil {
			t.closeSockets()
			return nil, err
		}
	}
	if err := sock.Bind(addr); err != nil {
		t.closeSockets()
		return nil, fmt.Errorf("bind %s: %w", addr, err)
	}
	if t.ipcPath != "" {
		if err := os.Chmod(t.ipcPath, 0o600); err != nil {
			t.closeSockets()
			return nil, fmt.Errorf("chmod %s: %w", t.ipcPath, err)
		}
	}
	return t, nil
}

// configure sets the ROUTER's options and starts its monitor.
func (t *Transport) configure(o Options) error {
	for _, set := range []struct {
		name string
		f    func() error
	}{
		{"linger", func() error { return t.sock.SetLinger(0) }},
		// Replies are never dropped silently: a full queue is EAGAIN (the
		// reply waits in the client's outbox), a client that is gone is
		// EHOSTUNREACH.
		{"router mandatory", func() error { return t.sock.SetRouterMandatory(1) }},
		{"maxmsgsize", func() error { return t.sock.SetMaxmsgsize(MaxMessageBytes + 1024) }},
		{"heartbeat interval", func() error { return t.sock.SetHeartbeatIvl(o.HeartbeatInterval) }},
		{"heartbeat timeout", func() error { return t.sock.SetHeartbeatTimeout(o.HeartbeatTimeout) }},
		{"heartbeat ttl", func() error { return t.sock.SetHeartbeatTtl(o.HeartbeatTimeout) }},
	} {
		if err := set.f(); err != nil {
			return fmt.Errorf("zmq %s: %w", set.name, err)
		}
	}
	monAddr := fmt.Sprintf("inproc://sonard-monitor-%p", t)
	if err := t.sock.Monitor(monAddr, zmq.EVENT_ACCEPTED|zmq.EVENT_DISCONNECTED); err != nil {
		return fmt.Errorf("zmq monitor: %w", err)
	}
	var mon *zmq.Socket
	var err error
	if t.ctx != nil { // inproc endpoints live in one context
		mon, err = t.ctx.NewSocket(zmq.PAIR)
	} else {
		mon, err = zmq.NewSocket(zmq.PAIR)
	}
	if err != nil {
		return fmt.Errorf("zmq monitor socket: %w", err)
	}
	t.mon = mon
	// No event may be lost (a connection whose accept was missed would have
	// its requests taken for a closed connection's): an inproc pipe with a
	// receive high-water mark of 0 is unbounded.
	if err := mon.SetRcvhwm(0); err != nil {
		return fmt.Errorf("zmq monitor hwm: %w", err)
	}
	if err := mon.Connect(monAddr); err != nil {
		return fmt.Errorf("zmq monitor connect: %w", err)
	}
	return nil
}

// Serve receives requests and answers them until ctx is done. A message
// that cannot be decoded gets an error reply (id 0 when unknown); the
// server goes on serving.
func (t *Transport) Serve(ctx context.Context, h Handler) error {
	poller := zmq.NewPoller()
	poller.Add(t.sock, zmq.POLLIN)
	poller.Add(t.mon, zmq.POLLIN)
	ticker, _ := h.(Ticker)
	lastTick := time.Now()
	var act activity
	handled := false // the last round handled a message
	for ctx.Err() == nil {
		if now := time.Now(); ticker != nil && now.Sub(lastTick) >= time.Second {
			ticker.Tick(now)
			lastTick = now
		}
		wait := 100 * time.Millisecond
		if t.flush(h) {
			wait = 2 * time.Millisecond // replies wait for room, or parked requests for their turn
		}
		ready, err := poller.Poll(act.before(wait, handled)) // activity.go: short waits while clients are active
		handled = false
		if err != nil {
			if errors.Is(err, zmq.Errno(4)) { // EINTR
				continue
			}
			return fmt.Errorf("poll: %w", err)
		}
		message := false
		for _, p := range ready {
			if p.Socket == t.mon {
				t.events(h)
			} else {
				message = true
			}
		}
		if !message {
			continue
		}
		act.saw(time.Now())
		frames, fd, over, err := t.recv()
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(11) { // EAGAIN
				continue
			}
			return fmt.Errorf("recv: %w", err)
		}
		// Events produced before this message (its connection's accept,
		// the close of an earlier connection on the same descriptor).
		t.events(h)
		if over.frames > 0 {
			t.tooManyFrames(frames, over)
		} else {
			t.receive(h, frames, fd)
		}
		handled = true
	}
	return nil
}

// maxFrames is one more than the most frames a request can have (the routing
// id, the empty delimiter of a REQ client, the payload): messages of up to
// maxFrames frames get serveOne's errors about their shape.
const maxFrames = 4

// dropped is what recv discarded of a message with more than maxFrames frames.
type dropped struct{ frames, bytes int }

// recv receives one message and the descriptor of the connection it came
// on ("" when libzmq does not say). The descriptor is libzmq's "__fd"
// metadata; after a poll the ROUTER may have it on the payload frame only, so
// every frame is asked. ZMQ_MAXMSGSIZE bounds each frame, not their number:
// frames past maxFrames are received one at a time and discarded (over says
// how many), so a message of hundreds of 4 MiB frames is never held here.
func (t *Transport) recv() (frames [][]byte, fd string, over dropped, err error) {
	for {
		b, md, err := t.sock.RecvBytesWithMetadata(zmq.DONTWAIT, "__fd")
		if err != nil {
			return frames, fd, over, err
		}
		if len(frames) < maxFrames {
			frames = append(frames, b)
		} else {
			over.frames++
			over.bytes += len(b)
		}
		if v, ok := md["__fd"]; ok {
			fd = v
		}
		if more, err := t.sock.GetRcvmore(); err != nil || !more {
			return frames, fd, over, err
		}
	}
}

// tooManyFrames answers a message that had more frames than a request can
// (recv kept the first maxFrames) with an error, without executing it.
func (t *Transport) tooManyFrames(frames [][]byte, over dropped) {
	n, size := len(frames)+over.frames, over.bytes
	for _, f := range frames {
		size += len(f)
	}
	client := hex.EncodeToString(frames[0])
	t.log.Warn("refusing a message of too many frames", zap.String("client", client), zap.Int("frames", n), zap.Int("bytes", size))
	rep := Reply{Error: fmt.Sprintf("%v: message of %d frames (%d bytes) refused unread: a request is one payload frame "+
		"(after an empty delimiter for REQ sockets)", ErrProtocol, n, size)}
	t.send(client, t.replyFrames(frames[:1], rep))
}

// events handles the monitor's events that are waiting.
func (t *Transport) events(h Handler) {
	var over []int // connections accepted past maxConns
	for {
		ev, _, fd, err := t.mon.RecvEvent(zmq.DONTWAIT)
		if err != nil {
			break
		}
		var gone string
		switch ev {
		case zmq.EVENT_ACCEPTED:
			gone = t.conns.accepted(fd)
			if t.maxConns > 0 && t.conns.open() > t.maxConns {
				over = append(over, fd)
			}
		case zmq.EVENT_DISCONNECTED:
			gone = t.conns.closed(fd)
		}
		if gone != "" {
			t.disconnected(h, gone)
		}
	}
	t.refuse(over)
}

// refuse closes connections accepted past maxConns. libzmq aborts the whole
// process when accept fails with EMFILE (an assertion in its ipc:// listener,
// 4.3), and it cannot be told to stop accepting (unbinding the listener also
// drops the connections it accepted), so each connection past the bound is
// shut down as soon as its accept is reported: libzmq then sees it end and
// closes it (the descriptor stays libzmq's to close). Only a connection the
// table still holds as open and silent is shut down (the descriptor was not
// closed and reused since its accept, as far as the monitor has told). The
// connections libzmq accepts before their events arrive here take
// descriptors from the reserve package fdlimit keeps.
func (t *Transport) refuse(fds []int) {
	for _, fd := range fds {
		if !t.conns.silent(fd) {
			continue
		}
		_ = unix.Shutdown(fd, unix.SHUT_RDWR)
		t.refused++
		if now := time.Now(); now.Sub(t.refusedLog) >= time.Second {
			t.refusedLog = now
			t.log.Warn("too many connections: closing new ones", zap.Int("connections", t.conns.open()),
				zap.Int("limit", t.maxConns), zap.Int64("closed_so_far", t.refused))
		}
	}
}

func (t *Transport) disconnected(h Handler, client string) {
	if ob := t.out[client]; ob != nil && (len(ob.replies) > 0 || len(ob.parked) > 0) {
		t.log.Warn("client gone with replies or requests waiting", zap.String("client", client),
			zap.Int("replies", len(ob.replies)), zap.Int("requests", len(ob.parked)))
	}
	delete(t.out, client)
	if w, ok := h.(Watcher); ok {
		w.Disconnected(client)
	}
}

// receive takes one message: it is served now, or parked behind the
// client's replies that wait for room (backpressure), or dropped when its
// connection is already closed (nobody could read the reply).
func (t *Transport) receive(h Handler, frames [][]byte, fdText string) {
	received := Monotonic()
	if len(frames) < 2 {
		t.log.Warn("dropping message without routing id and payload", zap.Int("frames", len(frames)))
		return
	}
	client := hex.EncodeToString(frames[0])
	if fd, err := strconv.Atoi(fdText); err == nil {
		ok, first, gone := t.conns.message(fd, client)
		if gone != "" {
			t.disconnected(h, gone)
		}
		if !ok {
			t.stale++
			t.log.Debug("dropping a request of a closed connection", zap.String("client", client))
			return
		}
		if w, watcher := h.(Watcher); watcher && first {
			w.Connected(client)
		}
	}
	if ob := t.out[client]; ob != nil {
		ob.park(t, client, frames)
		return
	}
	t.send(client, t.serveOne(h, client, frames, received))
}

// serveOne executes one message, received at the Monotonic time received,
// and returns the reply's frames.
func (t *Transport) serveOne(h Handler, client string, frames [][]byte, received int64) [][]byte {
	id := frames[0]
	// REQ clients put an empty delimiter before the payload; keep it in replies.
	head := [][]byte{id}
	rest := frames[1:]
	if len(rest) >= 2 && len(rest[0]) == 0 {
		head = append(head, []byte{})
		rest = rest[1:]
	}
	var rep Reply
	if len(rest) != 1 {
		rep.Error = fmt.Sprintf("%v: expected 1 payload frame, got %d", ErrProtocol, len(rest))
	} else {
		rep = execute(h, t.log, client, rest[0], received)
	}
	return t.replyFrames(head, rep)
}

func (t *Transport) replyFrames(head [][]byte, rep Reply) [][]byte {
	return append(append([][]byte(nil), head...), encodeReply(rep, t.log))
}

// execute decodes one request of client, received at the Monotonic time
// received, runs it and returns its reply (with the times of its steps). Both
// transports serve a message through it.
func execute(h Handler, log *zap.Logger, client string, payload []byte, received int64) Reply {
	var rep Reply
	req, err := DecodeRequest(payload)
	decoded := Monotonic()
	rep.ID = req.ID
	if err == nil {
		var body any
		body, err = h.Handle(client, req)
		rep.Body = body
	}
	rep.Times = []int64{received, decoded, Monotonic()}
	if err != nil {
		// Every client value an error quotes is clipped where it is quoted
		// (package clip); this bounds the whole text too, so that an error
		// reply is always small (outbox.go relies on it).
		rep.Error = clip.N(err.Error(), MaxErrorBytes)
		log.Debug("request failed", zap.String("client", client), clip.Field("op", req.Op), zap.Uint64("id", req.ID),
			zap.String("error", rep.Error))
	} else {
		rep.OK = true
	}
	return rep
}

// encodeReply is the reply's message; a reply that cannot be encoded becomes
// an error reply saying why.
func encodeReply(rep Reply, log *zap.Logger) []byte {
	b, err := EncodeReply(rep)
	if err != nil {
		log.Error("encode reply", zap.Error(err))
		b, _ = EncodeReply(Reply{ID: rep.ID, Error: "encode reply: " + err.Error()})
	}
	return b
}

// PeerPID is the process id of client, from its connection's peer
// credentials (SO_PEERCRED): only an ipc:// connection has one. It must be
// called from the handler (the goroutine that runs Serve).
func (t *Transport) PeerPID(client string) (int, error) {
	if t.ipcPath == "" {
		return 0, errors.New("a tcp:// client has no process on this machine")
	}
	fd, ok := t.conns.fd(client)
	if !ok {
		return 0, fmt.Errorf("client %s has no connection on record", client)
	}
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return 0, fmt.Errorf("peer credentials of client %s: %w", client, err)
	}
	return int(cred.Pid), nil
}

// Close closes the socket (after up to a second to deliver queued replies,
// such as the answer to a shutdown request) and removes an ipc:// socket file.
func (t *Transport) Close() error {
	_ = t.sock.SetLinger(time.Second)
	err := t.closeSockets()
	if t.ipcPath != "" {
		_ = os.Remove(t.ipcPath)
	}
	return err
}

// privateDir makes dir (mode 0700) or checks that an existing one is a real
// directory owned by this user and closed to others, so that no other local
// user can replace the socket.
func privateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("socket dir: %w", err)
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("socket dir: %w", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	switch {
	case !st.IsDir():
		return fmt.Errorf("socket dir %s is not a directory (symlink?)", dir)
	case !ok || int(sys.Uid) != os.Getuid():
		return fmt.Errorf("socket dir %s is not owned by this user", dir)
	case st.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("socket dir %s has mode %o: want no group/other access", dir, st.Mode().Perm())
	}
	return nil
}

// closeSockets stops the monitor and closes both sockets.
func (t *Transport) closeSockets() error {
	if t.mon != nil {
		_ = t.sock.Monitor("", 0)
		_ = t.mon.Close()
	}
	err := t.sock.Close()
	if t.ctx != nil {
		_ = t.ctx.Term()
	}
	return err
}
