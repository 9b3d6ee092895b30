package ipc

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"
)

// nopHandler answers every request with an empty body: the round trip
// without any handler work.
type nopHandler struct{}

func (nopHandler) Handle(string, Request) (any, error) { return nil, nil }

// BenchmarkRoundTrip compares one request's round trip through the
// Transport (poll, receive, decode, handle, encode, send) with a bare
// ZeroMQ ROUTER echo on the same kind of socket: the difference is what
// the Transport adds to ZeroMQ's own latency.
func BenchmarkRoundTrip(b *testing.B) {
	req, err := msgpack.Marshal(Request{V: Version, Op: "stats", ID: 1})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("zmq-echo", func(b *testing.B) {
		addr := "ipc://" + filepath.Join(b.TempDir(), "echo.sock")
		// A context of its own, as the Transport has: its own I/O thread,
		// not the client's (one I/O thread serving both ends of the
		// connection makes fewer hand-overs between threads).
		ctx, err := zmq.NewContext()
		if err != nil {
			b.Fatal(err)
		}
		defer ctx.Term()
		srv, err := ctx.NewSocket(zmq.ROUTER)
		if err != nil {
			b.Fatal(err)
		}
		if err := srv.Bind(addr); err != nil {
			b.Fatal(err)
		}
		// The socket is used and closed by the echo goroutine only (a ZeroMQ
		// socket closed under a blocked receive aborts the process).
		stop, done := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			defer srv.Close()
			poller := zmq.NewPoller()
			poller.Add(srv, zmq.POLLIN)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if ready, err := poller.Poll(10 * time.Millisecond); err != nil || len(ready) == 0 {
					continue
				}
				f, err := srv.RecvMessageBytes(0)
				if err != nil {
					return
				}
				if _, err := srv.SendMessage(f); err != nil {
					return
				}
			}
		}()
		roundTrips(b, addr, req)
		close(stop)
		<-done
	})
	b.Run("transport", func(b *testing.B) {
		addr := "ipc://" + filepath.Join(b.TempDir(), "run", "s.sock")
		tr, err := Listen(addr, zap.NewNop(), nil)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- tr.Serve(ctx, nopHandler{}) }()
		roundTrips(b, addr, req)
		cancel()
		<-done
		tr.Close()
	})
}

func roundTrips(b *testing.B, addr string, req []byte) {
	c, err := zmq.NewSocket(zmq.DEALER)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	c.SetLinger(0)
	if err := c.Connect(addr); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 100; i++ { // connect and warm up
		c.SendBytes(req, 0)
		c.RecvBytes(0)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.SendBytes(req, 0); err != nil {
			b.Fatal(err)
		}
		if _, err := c.RecvBytes(0); err != nil {
			b.Fatal(err)
		}
	}
}
