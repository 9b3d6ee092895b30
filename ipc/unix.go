package ipc

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The unix:// transport: a Unix stream socket, a goroutine per connection
// that reads a request, runs it and writes its reply itself.
//
// Why a second transport: with ZeroMQ every message passes through libzmq's
// I/O threads (the caller hands it over over an eventfd, both ends), and on
// virtual machines whose idle CPUs halt, each of those hand-overs that lands
// on another CPU costs tens of microseconds (docs/benchmarks.md,
// "Placement"). A plain socket read and written by the threads that produce
// and consume the messages lets the kernel's synchronous wake-up run the
// reader where the writer ran.
//
// Framing (docs/protocol.md): every frame is a 4-byte little-endian length,
// then that many bytes. A client's first frame is its id (1 to 255 bytes, the
// role of a ZeroMQ routing id); every later frame is one msgpack request, and
// every frame the server writes is one msgpack reply, in the order of the
// requests.

const (
	frameHeader = 4
	maxIDBytes  = 255
	// frameChunk bounds the memory a frame's reader takes ahead of the
	// bytes that arrived: a header announces up to MaxMessageBytes, which
	// are allocated as they come, not when announced.
	frameChunk = 64 << 10
)

// The unix:// transport's deadlines (UnixTransport's fields of the same
// names): a new connection must send its client id within HelloTimeout, and
// once a frame's header arrived its rest must within FrameTimeout; the
// connection is closed otherwise (logged). An identified connection waiting
// for its next request has no deadline: a training script may be idle for
// many minutes between steps.
const (
	DefaultHelloTimeout = 30 * time.Second
	DefaultFrameTimeout = 30 * time.Second
)

// errFrameTooLong is a frame longer than the reader allows.
var errFrameTooLong = errors.New("frame too long")

// UnixTransport serves a Handler on a Unix stream socket (unix:///path).
// Handle runs on the goroutine of the connection whose request it is, one
// request at a time, so the handler sees the same one-call-at-a-time
// discipline as on the ZeroMQ transport. The turns are granted in the order
// they were asked for, and each connection asks for one at a time, so a
// request waits for at most one request of each other client, as ZeroMQ's
// fair queueing bounds it (docs/reliability.md).
type UnixTransport struct {
	ln   *net.UnixListener
	log  *zap.Logger
	path string
	poll time.Duration // Options.Poll

	// HelloTimeout and FrameTimeout are the deadlines above; MaxConns
	// bounds the connections open at once (Options.MaxConns, 0: none): one
	// accepted past it is refused and closed. Set them before Serve.
	HelloTimeout, FrameTimeout time.Duration
	MaxConns                   int
	refused                    int64     // connections refused past MaxConns (guarded by mu)
	refusedLog                 time.Time // last logged refusal (guarded by mu)

	turn    fifoLock // held while the handler runs (Handle, Tick, Connected, Disconnected)
	h       Handler
	conns   map[string]*net.UnixConn // by client id (guarded by turn)
	stopped atomic.Bool              // no request runs once set

	mu   sync.Mutex
	open map[*net.UnixConn]struct{} // every accepted connection, for shutdown (guarded by mu)

	wg sync.WaitGroup // connection goroutines
}

// fifoLock is a mutex granted in the order Lock was called (sync.Mutex lets a
// newcomer take the lock before a goroutine that has waited less than 1 ms).
type fifoLock struct {
	mu      sync.Mutex
	held    bool
	waiting []chan struct{}
}

func (l *fifoLock) Lock() {
	l.mu.Lock()
	if !l.held {
		l.held = true
		l.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	l.waiting = append(l.waiting, ch)
	l.mu.Unlock()
	<-ch // the lock is handed over held
}

func (l *fifoLock) Unlock() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.waiting) == 0 {
		l.held = false
		return
	}
	next := l.waiting[0]
	l.waiting[0] = nil
	l.waiting = l.waiting[1:]
	close(next)
}

// ListenUnix binds a Unix stream socket at the path of addr ("unix:///path"):
// the directory is made (or checked) private to this user, mode 0700, and
// the socket file gets mode 0600. A socket file left by a server that is
// gone (nothing accepts on it) is replaced; one a live server listens on is
// an error.
func ListenUnix(addr string, log *zap.Logger, opts Options) (*UnixTransport, error) {
	if err := CheckEndpoint(addr, false); err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	path, ok := strings.CutPrefix(addr, "unix://")
	if !ok {
		return nil, fmt.Errorf("listen: %q is not a unix:// address", addr)
	}
	if err := privateDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("bind %s: %w", addr, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return &UnixTransport{ln: ln, log: log, path: path, poll: opts.Poll, conns: map[string]*net.UnixConn{},
		open: map[*net.UnixConn]struct{}{}, HelloTimeout: DefaultHelloTimeout, FrameTimeout: DefaultFrameTimeout,
		MaxConns: opts.MaxConns}, nil
}

// removeStaleSocket removes the socket file at path when no server accepts on
// it any more (a crashed server's), and refuses to take over a live one.
func removeStaleSocket(path string) error {
	st, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("socket %s: %w", path, err)
	}
	if st.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("socket %s: a file that is not a socket is in the way", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		_ = c.Close()
		return fmt.Errorf("socket %s: another server is listening on it", path)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("socket %s: removing the stale socket file: %w", path, err)
	}
	return nil
}

// Serve accepts connections and serves their requests until ctx is done
// (every accepted connection is then closed, after up to a second for the
// replies being written, such as the answer to a shutdown request). Tick
// runs about once a second, between requests.
func (t *UnixTransport) Serve(ctx context.Context, h Handler) error {
	t.turn.Lock()
	t.h = h
	t.turn.Unlock()
	accepted := make(chan error, 1)
	go func() { accepted <- t.accept() }()
	ticker, _ := h.(Ticker)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			t.stop()
			return nil
		case err := <-accepted:
			t.stop()
			if err == nil { // the listener was closed (Close before the context ended)
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		case now := <-tick.C:
			if ticker != nil {
				t.turn.Lock()
				ticker.Tick(now)
				t.turn.Unlock()
			}
		}
	}
}

// accept starts a goroutine for every connection until the listener closes.
func (t *UnixTransport) accept() error {
	for {
		c, err := t.ln.AcceptUnix()
		if err != nil {
			if t.stopped.Load() || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				t.log.Warn("accept: out of file descriptors; retrying", zap.Error(err))
				time.Sleep(100 * time.Millisecond)
				continue
			}
			return err
		}
		t.mu.Lock()
		if t.stopped.Load() {
			t.mu.Unlock()
			_ = c.Close()
			return nil
		}
		if t.MaxConns > 0 && len(t.open) >= t.MaxConns {
			t.refused++
			n, logIt := t.refused, time.Since(t.refusedLog) >= time.Second
			if logIt {
				t.refusedLog = time.Now()
			}
			t.mu.Unlock()
			if logIt { // at most once a second: a flood of connections must not flood the log
				t.log.Warn("too many connections: refusing new ones", zap.Int("limit", t.MaxConns), zap.Int64("refused_so_far", n))
			}
			t.refuse(c, fmt.Sprintf("too many connections: %d open (limit %d); try again later", t.MaxConns, t.MaxConns))
			_ = c.Close()
			continue
		}
		t.open[c] = struct{}{}
		t.wg.Add(1)
		t.mu.Unlock()
		go t.serveConn(c)
	}
}

// stop ends serving: no request runs after it returns, the connections stop
// reading, and those writing a reply get up to a second to finish.
func (t *UnixTransport) stop() {
	t.stopped.Store(true)
	t.turn.Lock() // the request running now, if any, ends first
	t.turn.Unlock()
	t.mu.Lock()
	for c := range t.open {
		_ = c.CloseRead()
	}
	t.mu.Unlock()
	_ = t.ln.Close()
	done := make(chan struct{})
	go func() { t.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Second):
		t.mu.Lock()
		for c := range t.open {
			_ = c.Close()
		}
		t.mu.Unlock()
		<-done
	}
}

// serveConn reads one client's id, then its requests, running each and
// writing its reply, until the client closes the connection or sends what
// cannot be a frame.
func (t *UnixTransport) serveConn(c *net.UnixConn) {
	defer t.wg.Done()
	defer func() {
		t.mu.Lock()
		delete(t.open, c)
		t.mu.Unlock()
		_ = c.Close()
	}()
	src := newPollingReader(c, t.poll)
	// The id is read without the request buffer (a connection that never
	// identifies itself costs no more than its socket and goroutine), and
	// exactly: nothing after it is consumed.
	_ = c.SetReadDeadline(time.Now().Add(t.HelloTimeout))
	id, err := readFrame(src, maxIDBytes, nil)
	if isTimeout(err) {
		t.log.Info("closing a connection that sent no client id in time", zap.Duration("timeout", t.HelloTimeout))
		return
	}
	if err != nil || len(id) == 0 {
		t.log.Debug("dropping a connection without a client id", zap.Error(err), zap.Int("bytes", len(id)))
		t.refuse(c, fmt.Sprintf("%v: the first frame must be a client id of 1 to %d bytes", ErrProtocol, maxIDBytes))
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	r := bufio.NewReaderSize(src, 64<<10)
	// A frame whose header arrived must be complete within FrameTimeout.
	deadline := false
	rest := func() {
		deadline = true
		_ = c.SetReadDeadline(time.Now().Add(t.FrameTimeout))
	}
	client := hex.EncodeToString(id)
	if !t.register(client, c) {
		t.refuse(c, fmt.Sprintf("%v: client id %s is already connected", ErrProtocol, client))
		return
	}
	defer t.unregister(client)
	for {
		payload, err := readFrame(r, MaxMessageBytes, rest)
		received := Monotonic()
		if deadline {
			deadline = false
			_ = c.SetReadDeadline(time.Time{})
		}
		if err != nil {
			if isTimeout(err) {
				t.log.Warn("closing a connection that stalled inside a frame", zap.String("client", client),
					zap.Duration("timeout", t.FrameTimeout), zap.Error(err))
			} else if errors.Is(err, errFrameTooLong) {
				t.log.Warn("closing a connection that sent an oversized frame", zap.String("client", client), zap.Error(err))
				t.refuse(c, fmt.Sprintf("%v: %v", ErrProtocol, err))
			} else if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				t.log.Debug("connection read failed", zap.String("client", client), zap.Error(err))
			}
			return
		}
		t.turn.Lock()
		if t.stopped.Load() {
			t.turn.Unlock()
			return
		}
		rep := execute(t.h, t.log, client, payload, received)
		t.turn.Unlock()
		if err := writeFrame(c, encodeReply(rep, t.log)); err != nil {
			t.log.Debug("connection write failed", zap.String("client", client), zap.Error(err))
			return
		}
	}
}

// register records client's connection and tells the handler; false when the
// id is already connected or the transport stopped.
func (t *UnixTransport) register(client string, c *net.UnixConn) bool {
	t.turn.Lock()
	defer t.turn.Unlock()
	if _, dup := t.conns[client]; dup || t.stopped.Load() {
		return false
	}
	t.conns[client] = c
	if w, ok := t.h.(Watcher); ok {
		w.Connected(client)
	}
	return true
}

// unregister forgets client's connection and tells the handler it closed.
func (t *UnixTransport) unregister(client string) {
	t.turn.Lock()
	defer t.turn.Unlock()
	delete(t.conns, client)
	if w, ok := t.h.(Watcher); ok && !t.stopped.Load() {
		w.Disconnected(client)
	}
}

// refuse writes an error reply (id 0) on a connection about to be closed.
func (t *UnixTransport) refuse(c *net.UnixConn, msg string) {
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_ = writeFrame(c, encodeReply(Reply{Error: msg}, t.log))
}

// PeerPID is the process id of client, from its connection's peer
// credentials (SO_PEERCRED). It must be called from the handler.
func (t *UnixTransport) PeerPID(client string) (int, error) {
	c, ok := t.conns[client]
	if !ok {
		return 0, fmt.Errorf("client %s has no connection on record", client)
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("peer credentials of client %s: %w", client, err)
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, fmt.Errorf("peer credentials of client %s: %w", client, err)
	}
	if cerr != nil {
		return 0, fmt.Errorf("peer credentials of client %s: %w", client, cerr)
	}
	return int(cred.Pid), nil
}

// Close stops serving if Serve has not, and removes the socket file.
func (t *UnixTransport) Close() error {
	if !t.stopped.Load() {
		t.stop()
	}
	if err := os.Remove(t.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove socket %s: %w", t.path, err)
	}
	return nil
}

// isTimeout says whether err is a read deadline passing.
func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// readFrame reads one frame of at most limit bytes. Once the header is read,
// rest (when not nil) is called unless the whole frame is already buffered
// (the connection's reader then sets the deadline for the rest). The frame's
// memory is taken as its bytes arrive: at most frameChunk ahead of them.
func readFrame(r io.Reader, limit int, rest func()) ([]byte, error) {
	var head [frameHeader]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return nil, err
	}
	n := int(binary.LittleEndian.Uint32(head[:]))
	if int64(n) > int64(limit) {
		return nil, fmt.Errorf("%w: %d bytes, the limit is %d", errFrameTooLong, n, limit)
	}
	if rest != nil {
		if br, ok := r.(*bufio.Reader); !ok || br.Buffered() < n {
			rest()
		}
	}
	if n <= frameChunk {
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, frameErr(n, err)
		}
		return b, nil
	}
	// A large frame is read in chunks, joined once all arrived.
	chunks := make([][]byte, 0, (n+frameChunk-1)/frameChunk)
	for got := 0; got < n; {
		c := make([]byte, min(frameChunk, n-got))
		if _, err := io.ReadFull(r, c); err != nil {
			return nil, frameErr(n, err)
		}
		chunks = append(chunks, c)
		got += len(c)
	}
	b := make([]byte, 0, n)
	for i, c := range chunks {
		b = append(b, c...)
		chunks[i] = nil
	}
	return b, nil
}

func frameErr(n int, err error) error {
	if errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("frame of %d bytes: %w", n, err)
}

// writeFrame writes b as one frame, in one write call.
func writeFrame(w io.Writer, b []byte) error {
	buf := make([]byte, frameHeader+len(b))
	binary.LittleEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[frameHeader:], b)
	_, err := w.Write(buf)
	return err
}
