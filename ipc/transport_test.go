package ipc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// stubHandler echoes the request, fails op "fail", and records clients.
type stubHandler struct {
	mu      sync.Mutex
	calls   int
	clients map[string]int
	delay   time.Duration // each request takes this long
}

func (h *stubHandler) Handle(client string, req Request) (any, error) {
	h.mu.Lock()
	h.calls++
	if h.clients == nil {
		h.clients = map[string]int{}
	}
	h.clients[client]++
	h.mu.Unlock()
	time.Sleep(h.delay)
	if req.Op == "fail" {
		return nil, errors.New("stub failure")
	}
	var body map[string]any
	if len(req.Body) > 0 {
		if err := msgpack.Unmarshal(req.Body, &body); err != nil {
			return nil, err
		}
	}
	return map[string]any{"op": req.Op, "id": req.ID, "body": body}, nil
}

func (h *stubHandler) count() (int, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls, len(h.clients)
}

// serve starts a transport on an ipc:// socket in a temporary directory and
// stops it when the test ends.
func serve(t *testing.T, h Handler) (addr, path string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "run", "s.sock") // Listen creates run/ with mode 0700
	addr = "ipc://" + path
	tr, err := Listen(addr, zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(startServing(t, tr, h, path))
	return addr, path
}

// startServing runs ep.Serve(h) and returns what stops it: cancel, wait for
// Serve (5 s at most), Close, and check that the socket file at path is gone.
func startServing(t testing.TB, ep Endpoint, h Handler, path string) func() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ep.Serve(ctx, h) }()
	return func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Serve did not stop")
		}
		if err := ep.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket file left after Close: %v", err)
		}
	}
}

func dealer(t *testing.T, addr string) *zmq.Socket {
	t.Helper()
	s, err := zmq.NewSocket(zmq.DEALER)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if err := s.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRcvtimeo(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := s.Connect(addr); err != nil {
		t.Fatal(err)
	}
	return s
}

type stubReply struct {
	V     int     `msgpack:"v"`
	ID    uint64  `msgpack:"id"`
	OK    bool    `msgpack:"ok"`
	Error string  `msgpack:"error"`
	Times []int64 `msgpack:"t"`
	Body  struct {
		Op   string         `msgpack:"op"`
		ID   uint64         `msgpack:"id"`
		Body map[string]any `msgpack:"body"`
	} `msgpack:"body"`
}

func recvReply(t *testing.T, s *zmq.Socket) ([][]byte, stubReply) {
	t.Helper()
	frames, err := s.RecvMessageBytes(0)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	var r stubReply
	if err := msgpack.Unmarshal(frames[len(frames)-1], &r); err != nil {
		t.Fatalf("reply is not msgpack: %v", err)
	}
	if r.V != Version {
		t.Errorf("reply version %d", r.V)
	}
	return frames, r
}

func send(t *testing.T, s *zmq.Socket, frames ...[]byte) {
	t.Helper()
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	if _, err := s.SendMessage(parts...); err != nil {
		t.Fatal(err)
	}
}

func TestTransportRoundTrip(t *testing.T) {
	h := &stubHandler{}
	addr, path := serve(t, h)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
		t.Errorf("socket file mode %v, want a socket with 0600", st.Mode())
	}

	c := dealer(t, addr)
	send(t, c, envelope(t, Version, "hello", 1, map[string]any{"client": "test"}))
	frames, r := recvReply(t, c)
	if len(frames) != 1 {
		t.Errorf("reply has %d frames, want 1", len(frames))
	}
	if !r.OK || r.ID != 1 || r.Error != "" || r.Body.Op != "hello" || r.Body.Body["client"] != "test" {
		t.Errorf("reply %+v", r)
	}

	// Pipelined requests are answered in order.
	const n = 200
	for i := range n {
		send(t, c, envelope(t, Version, "ping", uint64(100+i), map[string]any{"i": i}))
	}
	for i := range n {
		_, r := recvReply(t, c)
		if !r.OK || r.ID != uint64(100+i) {
			t.Fatalf("pipelined reply %d: %+v", i, r)
		}
	}

	// A handler error is an error reply carrying the id.
	send(t, c, envelope(t, Version, "fail", 7, nil))
	if _, r := recvReply(t, c); r.OK || r.ID != 7 || r.Error != "stub failure" {
		t.Errorf("handler error reply %+v", r)
	}

	// REQ-style framing (empty delimiter) is answered with the delimiter.
	send(t, c, []byte{}, envelope(t, Version, "req", 8, nil))
	frames, r = recvReply(t, c)
	if len(frames) != 2 || len(frames[0]) != 0 || !r.OK || r.ID != 8 {
		t.Errorf("delimited request: %d frames, reply %+v", len(frames), r)
	}
}

// TestReplyTimes: every reply, an error's too, carries the server's
// CLOCK_MONOTONIC readings at receipt, decoding and handling, in that order,
// between the client's readings of the same clock around the round trip;
// the handler's time falls between the last two.
func TestReplyTimes(t *testing.T) {
	h := &stubHandler{delay: 3 * time.Millisecond}
	addr, _ := serve(t, h)
	c := dealer(t, addr)
	for _, op := range []string{"ping", "fail"} {
		before := Monotonic()
		send(t, c, envelope(t, Version, op, 1, nil))
		_, r := recvReply(t, c)
		after := Monotonic()
		if len(r.Times) != 3 {
			t.Fatalf("%s: reply times %v, want 3", op, r.Times)
		}
		recv, dec, done := r.Times[0], r.Times[1], r.Times[2]
		if before >= recv || recv > dec || dec > done || done >= after {
			t.Errorf("%s: client %d .. %d, server received %d decoded %d handled %d: out of order", op, before, after, recv, dec, done)
		}
		if got := time.Duration(done - dec); got < h.delay {
			t.Errorf("%s: handled %v after decoding, the handler alone takes %v", op, got, h.delay)
		}
	}
}

func TestTransportBadMessages(t *testing.T) {
	h := &stubHandler{}
	addr, _ := serve(t, h)
	c := dealer(t, addr)
	cases := []struct {
		name    string
		frames  [][]byte
		wantErr string
		wantID  uint64
	}{
		{"malformed payload", [][]byte{[]byte("not msgpack \xc1")}, "malformed msgpack", 0},
		{"empty payload", [][]byte{{}}, "malformed msgpack", 0},
		{"wrong version", [][]byte{envelope(t, 3, "hello", 11, nil)}, "unsupported protocol version 3 (server speaks 1)", 11},
		{"missing op", [][]byte{mustMarshal(t, map[string]any{"v": Version, "id": 12})}, "missing op", 12},
		{"two payload frames", [][]byte{envelope(t, Version, "a", 13, nil), envelope(t, Version, "b", 14, nil)}, "expected 1 payload frame, got 2", 0},
		{"delimiter and two payload frames", [][]byte{{}, envelope(t, Version, "a", 15, nil), envelope(t, Version, "b", 16, nil)}, "expected 1 payload frame, got 2", 0},
		{"oversize", [][]byte{envelope(t, Version, "big", 17, map[string]any{"pad": make([]byte, MaxMessageBytes)})}, "exceeds", 0},
	}
	for _, tc := range cases {
		send(t, c, tc.frames...)
		_, r := recvReply(t, c)
		if r.OK || r.ID != tc.wantID || !strings.Contains(r.Error, tc.wantErr) || !strings.Contains(r.Error, "protocol error") {
			t.Errorf("%s: reply %+v, want ok=false id=%d and an error containing %q", tc.name, r, tc.wantID, tc.wantErr)
		}
		// The server keeps serving.
		send(t, c, envelope(t, Version, "after", 99, nil))
		if _, r := recvReply(t, c); !r.OK || r.ID != 99 {
			t.Fatalf("%s: request after it: %+v", tc.name, r)
		}
	}
	if calls, _ := h.count(); calls != len(cases) {
		t.Errorf("handler called %d times, want %d (never for bad messages)", calls, len(cases))
	}
}

func TestTransportClientsSeparate(t *testing.T) {
	h := &stubHandler{}
	addr, _ := serve(t, h)
	const clients, each = 4, 50
	socks := make([]*zmq.Socket, clients)
	for i := range socks {
		socks[i] = dealer(t, addr)
	}
	// Interleave the clients' requests; each gets only its own replies, in order.
	for j := range each {
		for i, s := range socks {
			send(t, s, envelope(t, Version, fmt.Sprintf("c%d", i), uint64(j), nil))
		}
	}
	for i, s := range socks {
		for j := range each {
			_, r := recvReply(t, s)
			if !r.OK || r.ID != uint64(j) || r.Body.Op != fmt.Sprintf("c%d", i) {
				t.Fatalf("client %d reply %d: %+v", i, j, r)
			}
		}
	}
	if _, n := h.count(); n != clients {
		t.Errorf("handler saw %d client ids, want %d", n, clients)
	}
}

func TestListenErrors(t *testing.T) {
	dir := t.TempDir()
	blocker := filepath.Join(dir, "file")
	if err := os.WriteFile(blocker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, addr := range []string{
		"ipc://" + filepath.Join(blocker, "sub", "s.sock"), // a file where a directory must be
		"bogus://nowhere",
		"tcp://127.0.0.1:0", // tcp:// without CURVE keys
	} {
		if tr, err := Listen(addr, zap.NewNop(), nil); err == nil {
			tr.Close()
			t.Errorf("Listen(%q) succeeded", addr)
		}
	}
	// The socket directory is created, private.
	sub := filepath.Join(dir, "new", "dir")
	tr, err := Listen("ipc://"+filepath.Join(sub, "s.sock"), zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	st, err := os.Stat(sub)
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("socket directory: %v, %v", st.Mode(), err)
	}
}

func TestListenRefusesSharedSocketDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "shared")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if tr, err := Listen("ipc://"+filepath.Join(dir, "s.sock"), zap.NewNop(), nil); err == nil {
		tr.Close()
		t.Fatal("Listen accepted a world-writable socket directory")
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if tr, err := Listen("ipc://"+filepath.Join(link, "s.sock"), zap.NewNop(), nil); err == nil {
		tr.Close()
		t.Fatal("Listen accepted a symlinked socket directory")
	}
}
