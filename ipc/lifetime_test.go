package ipc

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

func TestCheckEndpoint(t *testing.T) {
	for _, c := range []struct {
		addr  string
		curve bool
		ok    bool
	}{
		{"ipc:///run/sonard/s.sock", false, true},
		{"ipc:///run/sonard/s.sock", true, true},
		{"tcp://127.0.0.1:5555", true, true},
		{"tcp://127.0.0.1:5555", false, false},
		{"ipc://@abstract", false, false},
		{"ipc://relative/s.sock", false, false},
		{"unix:///run/sonard/s.sock", false, true},
		{"unix://relative/s.sock", false, false},
		{"unix://@abstract", false, false},
		{"ws://127.0.0.1:5555", false, false},
		{"ws://127.0.0.1:5555", true, false},
		{"wss://127.0.0.1:5555", true, false},
		{"inproc://x", false, false},
		{"pgm://eth0;239.192.1.1:5555", true, false},
		{"epgm://eth0;239.192.1.1:5555", true, false},
		{"tipc://{5560,0,0}", true, false},
		{"vmci://1:5555", true, false},
		{"udp://127.0.0.1:5555", true, false},
		{"TCP://127.0.0.1:5555", true, false},
		{"127.0.0.1:5555", true, false},
		{"", false, false},
	} {
		err := CheckEndpoint(c.addr, c.curve)
		if (err == nil) != c.ok {
			t.Errorf("CheckEndpoint(%q, curve=%v) = %v, want ok=%v", c.addr, c.curve, err, c.ok)
		}
		if err != nil && !errors.Is(err, ErrTransport) {
			t.Errorf("CheckEndpoint(%q): %v is not ErrTransport", c.addr, err)
		}
		if !c.ok && !strings.HasPrefix(c.addr, "tcp://") {
			if tr, err := Listen(c.addr, zap.NewNop(), &Curve{ServerSecret: "x", ClientKeys: []string{"y"}}); err == nil {
				tr.Close()
				t.Errorf("Listen(%q) succeeded", c.addr)
			} else if !strings.Contains(err.Error(), "not allowed") && c.addr != "" {
				t.Errorf("Listen(%q): %v does not say the transport is not allowed", c.addr, err)
			}
		}
	}
}

// watchHandler is stubHandler that records disconnections.
type watchHandler struct {
	stubHandler
	mu   sync.Mutex
	gone []string
}

func (h *watchHandler) Connected(string) {}

func (h *watchHandler) Disconnected(client string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.gone = append(h.gone, client)
}

func (h *watchHandler) disconnected() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.gone...)
}

func request(t *testing.T, op string, id uint64) []byte {
	t.Helper()
	b, err := msgpack.Marshal(map[string]any{"v": Version, "op": op, "id": id, "body": map[string]any{}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDisconnectReleasesClientOfThatConnection(t *testing.T) {
	h := &watchHandler{}
	addr, _ := serve(t, h)
	a, b := dealer(t, addr), dealer(t, addr)
	for i, s := range []*zmq.Socket{a, b} {
		send(t, s, request(t, "hello", uint64(i+1)))
		recvReply(t, s)
	}
	_, clients := h.count()
	if clients != 2 {
		t.Fatalf("%d clients", clients)
	}
	a.Close()
	deadline := time.Now().Add(2 * time.Second)
	for len(h.disconnected()) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	gone := h.disconnected()
	if len(gone) != 1 {
		t.Fatalf("disconnected %v, want the one closed client", gone)
	}
	// The other client is still served, and its close is seen too.
	send(t, b, request(t, "hello", 9))
	if _, r := recvReply(t, b); !r.OK || r.ID != 9 {
		t.Fatalf("reply %+v", r)
	}
	b.Close()
	for len(h.disconnected()) < 2 && time.Now().Before(deadline.Add(2*time.Second)) {
		time.Sleep(10 * time.Millisecond)
	}
	if gone := h.disconnected(); len(gone) != 2 || gone[0] == gone[1] {
		t.Fatalf("disconnected %v, want both clients once", gone)
	}
}

// A client that pipelines far more requests than ZeroMQ queues (SNDHWM
// 1000) before reading gets one reply per request: executed, or "busy" (not
// executed); none is dropped.
func TestEveryRequestGetsAReplyPastTheHighWaterMark(t *testing.T) {
	h := &watchHandler{}
	addr, _ := serve(t, h)
	s := dealer(t, addr)
	if err := s.SetSndhwm(0); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRcvhwm(10); err != nil {
		t.Fatal(err)
	}
	const n = 6000
	for i := 1; i <= n; i++ {
		send(t, s, request(t, "ping", uint64(i)))
	}
	time.Sleep(500 * time.Millisecond) // let the server fill every queue
	seen := map[uint64]bool{}
	busy := 0
	for len(seen) < n {
		_, r := recvReply(t, s)
		if seen[r.ID] {
			t.Fatalf("two replies to %d", r.ID)
		}
		seen[r.ID] = true
		if !r.OK {
			if !strings.HasPrefix(r.Error, "busy:") {
				t.Fatalf("reply %+v", r)
			}
			busy++
		}
	}
	calls, _ := h.count()
	if calls+busy != n {
		t.Errorf("%d executed + %d busy != %d requests", calls, busy, n)
	}
	t.Logf("%d requests: %d executed, %d answered busy", n, calls, busy)
}

// blockingHandler holds the serving loop on its first request until
// released.
type blockingHandler struct {
	watchHandler
	once    sync.Once
	release chan struct{}
}

func (h *blockingHandler) Handle(client string, req Request) (any, error) {
	h.once.Do(func() { <-h.release })
	return h.watchHandler.Handle(client, req)
}

// While a request holds the loop, thousands of connections come and go:
// no monitor event may be lost, or the requests of a connection whose
// accept was missed would be dropped as those of a closed one.
func TestNoConnectionEventLostWhileTheLoopIsBusy(t *testing.T) {
	h := &blockingHandler{release: make(chan struct{})}
	addr, _ := serve(t, h)
	first := dealer(t, addr)
	send(t, first, request(t, "hello", 1))
	time.Sleep(100 * time.Millisecond) // the loop now waits in Handle
	for i := 0; i < 900; i++ {         // 1,800 events
		s, err := zmq.NewSocket(zmq.DEALER)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.SetLinger(0)
		if err := s.Connect(addr); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
		s.Close()
	}
	const open = 300 // 300 more: past libzmq's default 2,000 queued events
	socks := make([]*zmq.Socket, open)
	for i := range socks {
		socks[i] = dealer(t, addr)
		send(t, socks[i], request(t, "hello", uint64(10+i)))
	}
	time.Sleep(200 * time.Millisecond)
	close(h.release)
	recvReply(t, first)
	for i, s := range socks {
		if _, r := recvReply(t, s); !r.OK || r.ID != uint64(10+i) {
			t.Fatalf("client %d: reply %+v", i, r)
		}
	}
}
