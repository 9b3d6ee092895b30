package ipc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"
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

// Transport is a ZeroMQ ROUTER socket serving a Handler. Clients use DEALER
// sockets (requests may be pipelined) and send one frame per message.
type Transport struct {
	sock *zmq.Socket
	// ctx is the socket's own ZeroMQ context (nil with CURVE: authentication runs in the
	// default context). Close terminates it, which is what makes the linger wait happen.
	ctx  *zmq.Context
	log  *zap.Logger
	addr string
	// ipcPath is the socket file of an ipc:// endpoint, removed on Close.
	ipcPath string
}

// Curve configures ZeroMQ CURVE authentication and encryption: the server's
// secret key and the public keys of the clients allowed to connect (Z85).
type Curve struct {
	ServerSecret string
	ClientKeys   []string
}

// Listen binds a ROUTER socket to addr ("ipc:///path" or "tcp://host:port").
// For ipc:// the socket file is created with mode 0600 in a private
// directory. tcp:// requires curve: only clients holding an allowed key
// can connect.
func Listen(addr string, log *zap.Logger, curve *Curve) (*Transport, error) {
	if strings.HasPrefix(addr, "tcp://") && (curve == nil || curve.ServerSecret == "" || len(curve.ClientKeys) == 0) {
		return nil, fmt.Errorf("listen %s: tcp:// needs CURVE authentication (a server secret key and allowed client keys)", addr)
	}
	var ctx *zmq.Context
	var sock *zmq.Socket
	var err error
	if curve != nil && curve.ServerSecret != "" {
		sock, err = zmq.NewSocket(zmq.ROUTER)
	} else if ctx, err = zmq.NewContext(); err == nil {
		if sock, err = ctx.NewSocket(zmq.ROUTER); err != nil {
			_ = ctx.Term()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("zmq socket: %w", err)
	}
	abandon := func() { // on a failure below
		_ = sock.Close()
		if ctx != nil {
			_ = ctx.Term()
		}
	}
	if curve != nil && curve.ServerSecret != "" {
		zmq.AuthSetVerbose(false)
		if err := zmq.AuthStart(); err != nil {
			abandon()
			return nil, fmt.Errorf("zmq auth: %w", err)
		}
		zmq.AuthCurveAdd("sonar", curve.ClientKeys...)
		if err := sock.ServerAuthCurve("sonar", curve.ServerSecret); err != nil {
			abandon()
			return nil, fmt.Errorf("zmq curve: %w", err)
		}
	}
	if err := sock.SetLinger(0); err != nil {
		abandon()
		return nil, fmt.Errorf("zmq linger: %w", err)
	}
	// A reply to a client that went away is dropped, not an error.
	if err := sock.SetRouterMandatory(0); err != nil {
		abandon()
		return nil, fmt.Errorf("zmq router mandatory: %w", err)
	}
	if err := sock.SetMaxmsgsize(MaxMessageBytes + 1024); err != nil {
		abandon()
		return nil, fmt.Errorf("zmq maxmsgsize: %w", err)
	}
	t := &Transport{sock: sock, ctx: ctx, log: log, addr: addr}
	if p, ok := strings.CutPrefix(addr, "ipc://"); ok {
		t.ipcPath = p
		if err := privateDir(filepath.Dir(p)); err != nil {
			abandon()
			return nil, err
		}
	}
	if err := sock.Bind(addr); err != nil {
		abandon()
		return nil, fmt.Errorf("bind %s: %w", addr, err)
	}
	if t.ipcPath != "" {
		if err := os.Chmod(t.ipcPath, 0o600); err != nil {
			abandon()
			return nil, fmt.Errorf("chmod %s: %w", t.ipcPath, err)
		}
	}
	return t, nil
}

// Serve receives requests and answers them until ctx is done. A message
// that cannot be decoded gets an error reply (id 0 when unknown); the
// server goes on serving.
func (t *Transport) Serve(ctx context.Context, h Handler) error {
	poller := zmq.NewPoller()
	poller.Add(t.sock, zmq.POLLIN)
	ticker, _ := h.(Ticker)
	lastTick := time.Now()
	for ctx.Err() == nil {
		if now := time.Now(); ticker != nil && now.Sub(lastTick) >= time.Second {
			ticker.Tick(now)
			lastTick = now
		}
		ready, err := poller.Poll(100 * time.Millisecond)
		if err != nil {
			if errors.Is(err, zmq.Errno(4)) { // EINTR
				continue
			}
			return fmt.Errorf("poll: %w", err)
		}
		if len(ready) == 0 {
			continue
		}
		frames, err := t.sock.RecvMessageBytes(zmq.DONTWAIT)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(11) { // EAGAIN
				continue
			}
			return fmt.Errorf("recv: %w", err)
		}
		t.serveOne(h, frames)
	}
	return nil
}

func (t *Transport) serveOne(h Handler, frames [][]byte) {
	if len(frames) < 2 {
		t.log.Warn("dropping message without routing id and payload", zap.Int("frames", len(frames)))
		return
	}
	id := frames[0]
	client := fmt.Sprintf("%x", id)
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
		req, err := DecodeRequest(rest[0])
		rep.ID = req.ID
		if err == nil {
			var body any
			body, err = h.Handle(client, req)
			rep.Body = body
		}
		if err != nil {
			rep.Error = err.Error()
			t.log.Debug("request failed", zap.String("client", client), zap.String("op", req.Op), zap.Uint64("id", req.ID), zap.Error(err))
		} else {
			rep.OK = true
		}
	}
	b, err := EncodeReply(rep)
	if err != nil {
		t.log.Error("encode reply", zap.Error(err))
		return
	}
	parts := make([]any, 0, len(head)+1)
	for _, p := range head {
		parts = append(parts, p)
	}
	parts = append(parts, b)
	if _, err := t.sock.SendMessageDontwait(parts...); err != nil {
		t.log.Warn("reply not sent", zap.String("client", client), zap.Error(err))
	}
}

// Close closes the socket, delivering queued replies (such as the answer to
// a shutdown request) for up to a second, and removes an ipc:// socket file.
// The wait happens when the socket's own context is terminated: closing a
// socket only hands it to ZeroMQ's background threads, which a process that
// exits right after would end before they send.
func (t *Transport) Close() error {
	_ = t.sock.SetLinger(time.Second)
	err := t.sock.Close()
	if t.ctx != nil {
		if e := t.ctx.Term(); e != nil && err == nil {
			err = e
		}
	}
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
