package ipc

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"
)

// pairSockets returns n connected PAIR socket pairs over inproc (receiving
// end first).
func pairSockets(t *testing.T, n int) (recv, send []*zmq.Socket) {
	t.Helper()
	for i := range n {
		r, err := zmq.NewSocket(zmq.PAIR)
		if err != nil {
			t.Fatal(err)
		}
		s, err := zmq.NewSocket(zmq.PAIR)
		if err != nil {
			t.Fatal(err)
		}
		addr := fmt.Sprintf("inproc://ready-%s-%d", t.Name(), i)
		if err := r.Bind(addr); err != nil {
			t.Fatal(err)
		}
		if err := s.Connect(addr); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close(); r.Close() })
		recv, send = append(recv, r), append(send, s)
	}
	return recv, send
}

// TestSignalsWait: a wait in Go's poller returns when a message comes to
// any watched socket (not only after its timeout), times out when none
// comes, and a message that came before the wait is seen by pending.
func TestSignalsWait(t *testing.T) {
	cases := []struct {
		name     string
		sendTo   int           // socket a message is sent to; -1: none
		sendAt   time.Duration // after the wait started; <0: before it
		wantPend []bool
		timeout  time.Duration // of each wait
		maxWait  time.Duration // until pending says what was sent
	}{
		{"nothing comes: timeout", -1, 0, []bool{false, false}, 150 * time.Millisecond, 2 * time.Second},
		// A message must end the wait long before its timeout.
		{"message to the first during the wait", 0, 30 * time.Millisecond, []bool{true, false}, 5 * time.Second, time.Second},
		{"message to the second during the wait", 1, 30 * time.Millisecond, []bool{false, true}, 5 * time.Second, time.Second},
		{"message before the wait", 0, -1, []bool{true, false}, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			recv, send := pairSockets(t, 2)
			sig, err := watch(recv...)
			if err != nil {
				t.Fatalf("watch: %v", err)
			}
			defer sig.close()
			if p := sig.pending(); p[0] || p[1] {
				t.Fatalf("pending %v before anything was sent", p)
			}
			if c.sendTo >= 0 && c.sendAt < 0 {
				if _, err := send[c.sendTo].Send("x", 0); err != nil {
					t.Fatal(err)
				}
				time.Sleep(10 * time.Millisecond) // inproc delivery
				if p := sig.pending(); !equalBools(p, c.wantPend) {
					t.Fatalf("pending %v, want %v", p, c.wantPend)
				}
				return
			}
			// The sender runs on its own thread: ZeroMQ sockets belong to
			// one goroutine at a time, which holds for send[i] here.
			done := make(chan error, 1)
			if c.sendTo >= 0 {
				go func() {
					time.Sleep(c.sendAt)
					_, err := send[c.sendTo].Send("x", 0)
					done <- err
				}()
			}
			timeout := c.timeout
			start := time.Now()
			deadline := start.Add(c.maxWait)
			var p []bool
			for {
				if err := sig.wait(timeout); err != nil {
					t.Fatalf("wait: %v", err)
				}
				if p = sig.pending(); p[0] || p[1] || c.sendTo < 0 || time.Now().After(deadline) {
					break // a wait may end without a message: ask again
				}
			}
			took := time.Since(start)
			if c.sendTo >= 0 {
				if err := <-done; err != nil {
					t.Fatal(err)
				}
			}
			if !equalBools(p, c.wantPend) {
				t.Fatalf("pending %v after %v, want %v", p, took, c.wantPend)
			}
			if c.sendTo < 0 && took < timeout-5*time.Millisecond {
				t.Errorf("wait returned after %v with nothing sent, want about %v", took, timeout)
			}
			if took > c.maxWait {
				t.Errorf("wait took %v, want under %v", took, c.maxWait)
			}
		})
	}
}

func equalBools(a, b []bool) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestServeWaitsInGoPoller: a transport's requests are waited for in Go's
// poller, not in zmq_poll (whose blocked cgo call keeps the runtime's
// monitor thread waking every 20 us).
func TestServeWaitsInGoPoller(t *testing.T) {
	addr := "ipc://" + filepath.Join(t.TempDir(), "run", "s.sock") // Listen makes run/ private
	tr, err := Listen(addr, zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	w, err := tr.newWaiter()
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	if _, ok := w.(*netWait); !ok {
		t.Fatalf("Serve waits with %T, want *netWait", w)
	}
}
