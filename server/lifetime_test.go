package server

import (
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sonar-moe/sonar/ipc"
)

// A session lives as long as its connection (plus the grace period), never
// by the pid the client reports.
func TestSessionFollowsItsConnection(t *testing.T) {
	for _, c := range []struct {
		name             string
		close, reconnect bool // the connection closes; the client is back (a request) within the grace period
		after            time.Duration
		released         bool
	}{
		{"open connection, an hour of silence", false, false, time.Hour, false},
		{"closed, within grace", true, false, DefaultReconnectGrace / 2, false},
		{"closed, grace over", true, false, DefaultReconnectGrace + time.Second, true},
		{"closed, back within grace", true, true, time.Hour, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := newWorld(t)
			w.s.IdleTimeout = time.Minute // applies only to connections nobody watches
			w.s.Connected(w.client)
			// The pid a client reports is a label only: a pid of another
			// namespace, or of a process that exited, changes nothing.
			w.must(w.client, ipc.OpHello, ipc.Hello{Client: "test", PID: 1 << 30})
			now := time.Now()
			if c.close {
				w.s.Disconnected(w.client)
			}
			if c.reconnect {
				w.s.Connected(w.client)
				w.must(w.client, ipc.OpHello, ipc.Hello{Client: "test"})
			}
			w.s.Tick(now.Add(c.after))
			if got := w.s.Stats().Sessions == 0; got != c.released {
				t.Fatalf("released %v, want %v", got, c.released)
			}
		})
	}
}

// Nothing of a client outlives its session: its metric series go with it.
func TestReleasedClientLeavesNoMetrics(t *testing.T) {
	w := newWorld(t)
	scrape := func() string {
		rec := httptest.NewRecorder()
		w.s.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		b, _ := io.ReadAll(rec.Result().Body)
		return string(b)
	}
	const n = 50
	for i := 0; i < n; i++ {
		c := fmt.Sprintf("client-%d", i)
		w.s.Connected(c)
		w.must(c, ipc.OpHello, ipc.Hello{Client: "test", PID: 1000 + i})
		w.must(c, ipc.OpStats, nil)
	}
	if got := strings.Count(scrape(), `sonard_client_requests_total{client="client-`); got != n {
		t.Fatalf("%d client series while %d clients are connected", got, n)
	}
	now := time.Now()
	for i := 0; i < n; i++ {
		c := fmt.Sprintf("client-%d", i)
		if i%2 == 0 {
			w.must(c, ipc.OpBye, nil)
		}
		w.s.Disconnected(c)
	}
	w.s.Tick(now.Add(DefaultReconnectGrace + time.Second))
	if m := scrape(); strings.Contains(m, `client="client-`) {
		t.Errorf("series of released clients remain:\n%s", m)
	}
	if len(w.s.watched) != 0 {
		t.Errorf("%d watched clients remain", len(w.s.watched))
	}
	// Stats-only clients open no session and leave no series either.
	w.must("passer-by", ipc.OpStats, nil)
	if m := scrape(); strings.Contains(m, "passer-by") {
		t.Error("a client without a session got a series")
	}
}

// Register costs time linear in the tensors it adds, not in those the
// session already holds: the request loop is shared by every client.
func TestRegisterIsLinear(t *testing.T) {
	w := newWorld(t)
	const batch, batches, window = 4, 20000, 1000 // 80,000 tensors in small requests
	ref := ipc.MemRef{Seg: w.params.id, Offset: 0, Bytes: 4}
	hyper := hyperMsg(w.ts[0].hyper)
	var first, last time.Duration // the first and last `window` requests
	for b := 0; b < batches; b++ {
		specs := make([]ipc.TensorSpec, batch)
		for i := range specs {
			specs[i] = ipc.TensorSpec{Name: fmt.Sprintf("t%d.%d", b, i), Shape: []int64{1}, DType: "float32", Param: ref, Hyper: hyper}
		}
		t0 := time.Now()
		w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: specs})
		switch d := time.Since(t0); {
		case b < window:
			first += d
		case b >= batches-window:
			last += d
		}
	}
	t.Logf("%d register requests of %d tensors: %v while the session held < %d, %v while it held > %d",
		window, batch, first, window*batch, last, (batches-window)*batch)
	if last > 4*first+50*time.Millisecond {
		t.Errorf("register slows down with the tensors held: %v then %v", first, last)
	}
	// A name already held is still refused.
	_, err := w.call(w.client, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "t0.0", Shape: []int64{1}, DType: "float32", Param: ref, Hyper: hyper}}})
	if err == nil || !strings.Contains(err.Error(), "already registered") {
		t.Errorf("duplicate name: %v", err)
	}
}
