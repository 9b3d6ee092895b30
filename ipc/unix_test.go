package ipc

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// serveUnix starts a UnixTransport in a temporary directory and stops it when
// the test ends (checking that Serve returns and the socket file is gone).
// Its connections poll for requests as sonard's do by default (--spin).
func serveUnix(t testing.TB, h Handler) (addr, path string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "run", "s.sock")
	addr = "unix://" + path
	ep, err := Open(addr, zap.NewNop(), nil, Options{Poll: 50 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(startServing(t, ep, h, path))
	return addr, path
}

// unixClient is a raw client of the framing, for tests.
type unixClient struct {
	t  testing.TB
	c  net.Conn
	r  *bufio.Reader
	id []byte
}

func dialUnix(t testing.TB, path string, id []byte) *unixClient {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	u := &unixClient{t: t, c: c, r: bufio.NewReader(c), id: id}
	if id != nil {
		u.frame(id)
	}
	return u
}

func (u *unixClient) frame(b []byte) {
	u.t.Helper()
	if err := writeFrame(u.c, b); err != nil {
		u.t.Fatalf("write frame: %v", err)
	}
}

func (u *unixClient) reply() (stubReply, error) {
	b, err := readFrame(u.r, MaxMessageBytes, nil)
	if err != nil {
		return stubReply{}, err
	}
	var r stubReply
	if err := msgpack.Unmarshal(b, &r); err != nil {
		u.t.Fatalf("reply is not msgpack: %v", err)
	}
	return r, nil
}

func (u *unixClient) mustReply() stubReply {
	u.t.Helper()
	r, err := u.reply()
	if err != nil {
		u.t.Fatalf("reply: %v", err)
	}
	if r.V != Version {
		u.t.Errorf("reply version %d", r.V)
	}
	return r
}

func TestUnixRoundTrip(t *testing.T) {
	h := &stubHandler{}
	_, path := serveUnix(t, h)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
		t.Errorf("socket file mode %v, want a socket with 0600", st.Mode())
	}
	id := []byte("S-client-one")
	c := dialUnix(t, path, id)
	before := Monotonic()
	c.frame(envelope(t, Version, "hello", 1, map[string]any{"client": "test"}))
	r := c.mustReply()
	after := Monotonic()
	if !r.OK || r.ID != 1 || r.Body.Op != "hello" || r.Body.Body["client"] != "test" {
		t.Errorf("reply %+v", r)
	}
	if len(r.Times) != 3 || r.Times[0] < before || r.Times[0] > r.Times[1] || r.Times[1] > r.Times[2] || r.Times[2] > after {
		t.Errorf("times %v not ordered within [%d, %d]", r.Times, before, after)
	}
	// Pipelined requests are answered in order.
	const n = 300
	for i := range n {
		c.frame(envelope(t, Version, "ping", uint64(100+i), map[string]any{"i": i}))
	}
	for i := range n {
		if r := c.mustReply(); !r.OK || r.ID != uint64(100+i) {
			t.Fatalf("pipelined reply %d: %+v", i, r)
		}
	}
	c.frame(envelope(t, Version, "fail", 7, nil))
	if r := c.mustReply(); r.OK || r.ID != 7 || r.Error != "stub failure" {
		t.Errorf("handler error reply %+v", r)
	}
	if calls, clients := h.count(); calls != n+2 || clients != 1 || h.clients[hex.EncodeToString(id)] != n+2 {
		t.Errorf("handler saw %d calls of %d clients (%v)", calls, clients, h.clients)
	}
}

// TestUnixBadInput: what cannot be a request gets an error reply (id 0) and
// the connection goes on; what cannot be a frame gets an error reply and the
// connection is closed; other clients are served throughout.
func TestUnixBadInput(t *testing.T) {
	h := &stubHandler{}
	_, path := serveUnix(t, h)
	good := dialUnix(t, path, []byte("good"))
	ping := func(id uint64) {
		t.Helper()
		good.frame(envelope(t, Version, "ping", id, nil))
		if r := good.mustReply(); !r.OK || r.ID != id {
			t.Fatalf("the good client's ping %d: %+v", id, r)
		}
	}
	ping(1)

	cases := []struct {
		name   string
		send   func(u *unixClient)
		closed bool   // the server closes the connection
		errHas string // in the error reply
	}{
		{"not msgpack", func(u *unixClient) { u.frame([]byte{0xc1, 0xff, 0x00}) }, false, "protocol"},
		{"wrong version", func(u *unixClient) { u.frame(envelope(t, Version+7, "ping", 3, nil)) }, false, "version"},
		{"empty frame", func(u *unixClient) { u.frame(nil) }, false, "protocol"},
		{"oversized length", func(u *unixClient) {
			var head [frameHeader]byte
			binary.LittleEndian.PutUint32(head[:], MaxMessageBytes+1)
			_, _ = u.c.Write(head[:])
		}, true, "too long"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			u := dialUnix(t, path, []byte("bad-"+c.name))
			c.send(u)
			r := u.mustReply()
			if r.OK || !strings.Contains(strings.ToLower(r.Error), c.errHas) {
				t.Errorf("reply %+v, want an error with %q", r, c.errHas)
			}
			if c.closed {
				if _, err := u.reply(); err == nil {
					t.Error("the connection stayed open")
				}
			} else {
				u.frame(envelope(t, Version, "ping", 9, nil))
				if r := u.mustReply(); !r.OK || r.ID != 9 {
					t.Errorf("after the bad frame: %+v", r)
				}
			}
			ping(10)
		})
	}

	// A client id that is empty or too long: refused and closed.
	for _, id := range [][]byte{{}, make([]byte, maxIDBytes+1)} {
		u := dialUnix(t, path, nil)
		u.frame(id)
		if r := u.mustReply(); r.OK || !strings.Contains(r.Error, "client id") {
			t.Errorf("id of %d bytes: %+v", len(id), r)
		}
		if _, err := u.reply(); err == nil {
			t.Errorf("id of %d bytes: the connection stayed open", len(id))
		}
	}
	// A frame cut short by the client's exit loses nothing of the others.
	u := dialUnix(t, path, []byte("cut"))
	var head [frameHeader]byte
	binary.LittleEndian.PutUint32(head[:], 100)
	_, _ = u.c.Write(append(head[:], "partial"...))
	u.c.Close()
	ping(11)
}

// TestUnixClients: a second connection with a connected client's id is
// refused; a closed connection tells the Watcher, once, under its client id;
// the handler never runs two requests at once.
func TestUnixClients(t *testing.T) {
	h := &watchHandler{}
	_, path := serveUnix(t, h)
	a := dialUnix(t, path, []byte("alpha"))
	a.frame(envelope(t, Version, "ping", 1, nil))
	a.mustReply()
	dup := dialUnix(t, path, []byte("alpha"))
	if r := dup.mustReply(); r.OK || !strings.Contains(r.Error, "already connected") {
		t.Errorf("duplicate id: %+v", r)
	}
	a.frame(envelope(t, Version, "ping", 2, nil))
	if r := a.mustReply(); !r.OK || r.ID != 2 {
		t.Errorf("the first connection after the duplicate: %+v", r)
	}
	a.c.Close()
	want := hex.EncodeToString([]byte("alpha"))
	deadline := time.Now().Add(5 * time.Second)
	for len(h.disconnected()) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := h.disconnected(); len(got) != 1 || got[0] != want {
		t.Errorf("disconnected %v, want [%s]", got, want)
	}
	// The id is free again once its connection closed.
	b := dialUnix(t, path, []byte("alpha"))
	b.frame(envelope(t, Version, "ping", 3, nil))
	if r := b.mustReply(); !r.OK || r.ID != 3 {
		t.Errorf("reconnected: %+v", r)
	}
}

// exclusiveHandler fails the test when two requests run at once.
type exclusiveHandler struct {
	t       *testing.T
	running atomic.Int32
	calls   atomic.Int32
}

func (h *exclusiveHandler) Handle(string, Request) (any, error) {
	if h.running.Add(1) != 1 {
		h.t.Error("two requests ran at once")
	}
	time.Sleep(50 * time.Microsecond)
	h.calls.Add(1)
	h.running.Add(-1)
	return map[string]any{}, nil
}

func TestUnixOneRequestAtATime(t *testing.T) {
	h := &exclusiveHandler{t: t}
	_, path := serveUnix(t, h)
	const clients, each = 6, 40
	var wg sync.WaitGroup
	for i := range clients {
		u := dialUnix(t, path, []byte{'c', byte(i)})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range each {
				if err := writeFrame(u.c, envelope(t, Version, "ping", uint64(j+1), nil)); err != nil {
					t.Error(err)
					return
				}
			}
			for range each {
				if _, err := u.reply(); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if got := h.calls.Load(); got != clients*each {
		t.Errorf("%d calls, want %d", got, clients*each)
	}
}

// peerHandler answers with PeerPID of the caller.
type peerHandler struct{ ep Endpoint }

func (h *peerHandler) Handle(client string, _ Request) (any, error) {
	pid, err := h.ep.PeerPID(client)
	return map[string]any{"op": "pid", "id": uint64(pid)}, err
}

func TestUnixPeerPID(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "s.sock")
	ep, err := Open("unix://"+path, zap.NewNop(), nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = ep.Serve(ctx, &peerHandler{ep: ep}) }()
	u := dialUnix(t, path, []byte("me"))
	u.frame(envelope(t, Version, "ping", 1, nil))
	if r := u.mustReply(); !r.OK || r.Body.ID != uint64(os.Getpid()) {
		t.Errorf("PeerPID reply %+v, want pid %d", r, os.Getpid())
	}
	if _, err := ep.PeerPID("nobody"); err == nil {
		t.Error("PeerPID of an unknown client: no error")
	}
}

// TestUnixSocketFile: a stale socket file (no server behind it) is replaced;
// a live server's socket and a file that is not a socket are left alone;
// curve keys are refused for unix://.
func TestUnixSocketFile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	ep, err := Open("unix://"+stale, zap.NewNop(), nil, Options{})
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	if _, err := Open("unix://"+stale, zap.NewNop(), nil, Options{}); err == nil || !strings.Contains(err.Error(), "another server") {
		t.Errorf("second server on a live socket: %v", err)
	}
	ep.Close()
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open("unix://"+plain, zap.NewNop(), nil, Options{}); err == nil {
		t.Error("a regular file was taken for a socket")
	}
	if b, _ := os.ReadFile(plain); string(b) != "keep" {
		t.Error("the regular file changed")
	}
	if _, err := Open("unix://"+filepath.Join(dir, "c.sock"), zap.NewNop(), &Curve{ServerSecret: "x", ClientKeys: []string{"y"}}, Options{}); !errors.Is(err, ErrTransport) {
		t.Errorf("curve with unix://: %v", err)
	}
}

// shutdownHandler ends serving from inside a request, as sonard's shutdown
// does, after a delay that keeps the reply in the writing.
type shutdownHandler struct{ cancel context.CancelFunc }

func (h *shutdownHandler) Handle(string, Request) (any, error) {
	h.cancel()
	return map[string]any{"op": "bye"}, nil
}

// TestUnixShutdownReplyDelivered: the reply to the request that stops the
// server still reaches its client; Serve returns and the file is removed.
func TestUnixShutdownReplyDelivered(t *testing.T) {
	for range 20 {
		path := filepath.Join(t.TempDir(), "run", "s.sock")
		ep, err := Open("unix://"+path, zap.NewNop(), nil, Options{})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- ep.Serve(ctx, &shutdownHandler{cancel: cancel}) }()
		u := dialUnix(t, path, []byte("owner"))
		u.frame(envelope(t, Version, "shutdown", 1, nil))
		if r := u.mustReply(); !r.OK || r.Body.Op != "bye" {
			t.Fatalf("shutdown reply %+v", r)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if err := ep.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("socket file left: %v", err)
		}
		if _, err := u.reply(); err == nil {
			t.Fatal("connection open after shutdown")
		}
	}
}

// TestUnixFairness: while one client pipelines many slow requests, another
// client's request waits for about one of them, not for the whole pipeline
// (turns are granted in order; docs/reliability.md's bound).
func TestUnixFairness(t *testing.T) {
	h := &stubHandler{delay: 2 * time.Millisecond}
	_, path := serveUnix(t, h)
	heavy := dialUnix(t, path, []byte("heavy"))
	const n = 100
	for i := range n {
		heavy.frame(envelope(t, Version, "ping", uint64(i+1), nil))
	}
	time.Sleep(10 * time.Millisecond) // the pipeline is being served
	light := dialUnix(t, path, []byte("light"))
	var worst time.Duration
	for i := range 5 {
		t0 := time.Now()
		light.frame(envelope(t, Version, "ping", uint64(i+1), nil))
		if r := light.mustReply(); !r.OK {
			t.Fatalf("light reply %+v", r)
		}
		worst = max(worst, time.Since(t0))
	}
	for range n {
		heavy.mustReply()
	}
	// One heavy request ahead and its own: about 4 ms; the whole pipeline would be 200 ms.
	if worst > 40*time.Millisecond {
		t.Errorf("the light client waited up to %v behind the heavy pipeline", worst)
	}
}

func TestFIFOLockOrder(t *testing.T) {
	var l fifoLock
	l.Lock()
	const n = 20
	order := make(chan int, n)
	for i := range n {
		go func() {
			l.Lock()
			order <- i
			l.Unlock()
		}()
		// Each goroutine queues before the next starts.
		for deadline := time.Now().Add(time.Second); ; {
			l.mu.Lock()
			queued := len(l.waiting)
			l.mu.Unlock()
			if queued == i+1 || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	l.Unlock()
	for i := range n {
		if got := <-order; got != i {
			t.Fatalf("turn %d went to goroutine %d", i, got)
		}
	}
}

// FuzzReadFrame: any byte stream splits into frames no longer than the limit,
// each with the length its header says, or stops with an error; never a panic.
func FuzzReadFrame(f *testing.F) {
	f.Add([]byte{3, 0, 0, 0, 'a', 'b', 'c', 0, 0, 0, 0})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{10, 0, 0, 0, 'x'})
	f.Add([]byte{1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bufio.NewReader(strings.NewReader(string(data)))
		used := 0
		for {
			b, err := readFrame(r, 64, nil)
			if err != nil {
				if errors.Is(err, errFrameTooLong) && len(data)-used >= frameHeader {
					n := binary.LittleEndian.Uint32(data[used:])
					if n <= 64 {
						t.Fatalf("frame of %d bytes called too long", n)
					}
				}
				return
			}
			if len(b) > 64 {
				t.Fatalf("frame of %d bytes past the limit", len(b))
			}
			if want := binary.LittleEndian.Uint32(data[used:]); int(want) != len(b) {
				t.Fatalf("frame of %d bytes, header says %d", len(b), want)
			}
			used += frameHeader + len(b)
		}
	})
}

// FuzzUnixStream: whatever bytes a connection sends (an id, frames, garbage,
// cut short), the server answers or closes it, and then still serves a
// well-behaved client.
func FuzzUnixStream(f *testing.F) {
	frame := func(b []byte) []byte {
		return append(binary.LittleEndian.AppendUint32(nil, uint32(len(b))), b...)
	}
	ping, err := msgpack.Marshal(map[string]any{"v": Version, "op": "ping", "id": 1})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(append(frame([]byte("id")), frame(ping)...))
	f.Add(append(frame([]byte("id")), frame([]byte{0xc1})...))
	f.Add(frame(nil))
	f.Add([]byte{0xff, 0xff, 0xff, 0x7f, 1, 2, 3})
	f.Add(append(frame([]byte("id")), 9, 0, 0, 0, 0x81))
	_, path := serveUnix(f, &stubHandler{})
	good := dialUnix(f, path, []byte("good"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Write(data)
		_ = c.(*net.UnixConn).CloseWrite()
		_, _ = io.Copy(io.Discard, c) // replies until the server closes or sees the end of the stream
		_ = good.c.SetDeadline(time.Now().Add(5 * time.Second))
		if err := writeFrame(good.c, envelope(t, Version, "ping", 42, nil)); err != nil {
			t.Fatal(err)
		}
		b, err := readFrame(good.r, MaxMessageBytes, nil)
		var r stubReply
		if err == nil {
			err = msgpack.Unmarshal(b, &r)
		}
		if err != nil || !r.OK || r.ID != 42 {
			t.Fatalf("the good client after %d fuzzed bytes: %+v, %v", len(data), r, err)
		}
	})
}
