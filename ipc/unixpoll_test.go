package ipc

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

func TestPollRule(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name      string
		poll      time.Duration
		lastWait  time.Duration // how long the previous wait took; <0: no previous wait
		wantPoll  bool
		wantUntil time.Duration // with wantPoll: until - start
	}{
		{"fresh rule polls", 50 * time.Microsecond, -1, true, 50 * time.Microsecond},
		{"no poll time never polls", 0, -1, false, 0},
		{"no poll time, quick wait", 0, 0, false, 0},
		{"a quick wait keeps polling", 50 * time.Microsecond, 0, true, 50 * time.Microsecond},
		{"a slow wait stops polling", 50 * time.Microsecond, 20 * time.Millisecond, false, 0},
		{"a long poll time, slow wait within it", time.Second, 20 * time.Millisecond, true, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := pollRule{poll: tc.poll}
			if tc.lastWait >= 0 {
				r.ended(time.Now().Add(-tc.lastWait))
			}
			until := r.until(now)
			if got := !until.IsZero(); got != tc.wantPoll {
				t.Fatalf("polls %v, want %v", got, tc.wantPoll)
			}
			if tc.wantPoll && until.Sub(now) != tc.wantUntil {
				t.Errorf("polls until start+%v, want start+%v", until.Sub(now), tc.wantUntil)
			}
		})
	}
	// A slow wait turns polling off; the next quick one turns it on again.
	r := pollRule{poll: time.Millisecond}
	r.ended(time.Now().Add(-10 * time.Millisecond))
	if !r.until(now).IsZero() {
		t.Fatal("still polling after a slow wait")
	}
	r.ended(time.Now())
	if r.until(now).IsZero() {
		t.Error("not polling again after a quick wait")
	}
}

// connPair is a connected pair of Unix stream sockets: the server's end (as
// the transport reads it) and the client's.
func connPair(t *testing.T) (srv *net.UnixConn, cli net.Conn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "p.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cli, err = net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv, err = ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close(); cli.Close() })
	return srv, cli
}

// readerOf is a pollingReader of srv in the state rule says, whatever the
// CPUs this process may use (newPollingReader polls only with several).
func readerOf(t *testing.T, srv *net.UnixConn, rule pollRule) *pollingReader {
	t.Helper()
	raw, err := srv.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return &pollingReader{raw: raw, rule: rule}
}

// processCPU is the CPU time this process has used so far.
func processCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestPollingReader: a hot reader polls (it reads the socket again and again
// while it waits), a cold one sleeps (it reads once, then again when the
// poller says data came), both read what comes, and the end of the stream ends
// a poll at once. The reads are counted rather than the CPU the wait cost: on
// a loaded machine a thread that yields between reads may get little CPU.
func TestPollingReader(t *testing.T) {
	const poll = 2 * time.Second // longer than any wait below: a hot read polls throughout
	const delay = 150 * time.Millisecond
	for _, tc := range []struct {
		name string
		cold bool
	}{
		{"hot: polls", false},
		{"cold: sleeps", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, cli := connPair(t)
			r := readerOf(t, srv, pollRule{poll: poll, cold: tc.cold})
			go func() {
				time.Sleep(delay)
				_, _ = cli.Write([]byte("request"))
			}()
			cpu0, t0 := processCPU(t), time.Now()
			buf := make([]byte, 64)
			n, err := r.Read(buf)
			cpu, wall := processCPU(t)-cpu0, time.Since(t0)
			if err != nil || string(buf[:n]) != "request" {
				t.Fatalf("read %q, %v", buf[:n], err)
			}
			if wall < delay*9/10 {
				t.Fatalf("read returned after %v, before the data was written (%v)", wall, delay)
			}
			if wall > poll {
				t.Errorf("read returned after %v: the poll outlasted the data's arrival", wall)
			}
			if !tc.cold && r.empty < 10 {
				t.Errorf("a hot read found the socket empty %d times over %v: it did not poll", r.empty, wall)
			}
			if tc.cold && r.empty > 2 { // one, or two after a spurious wake-up
				t.Errorf("a cold read found the socket empty %d times, want 1 (one read, then sleep; 2 at most)", r.empty)
			}
			if tc.cold && cpu > wall/3 {
				t.Errorf("a cold read used %v of CPU over %v: it polled", cpu, wall)
			}
			if r.rule.cold {
				t.Error("a wait shorter than the poll time left the rule cold")
			}
		})
	}
	t.Run("end of stream ends a poll", func(t *testing.T) {
		srv, cli := connPair(t)
		r := readerOf(t, srv, pollRule{poll: time.Hour})
		go func() {
			time.Sleep(50 * time.Millisecond)
			_ = srv.CloseRead() // as the transport's stop does
		}()
		start := time.Now()
		if _, err := r.Read(make([]byte, 8)); !errors.Is(err, io.EOF) {
			t.Errorf("read after CloseRead: %v, want EOF", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("CloseRead ended a poll after %v", d)
		}
		_ = cli
	})
	t.Run("no poll time reads the connection itself", func(t *testing.T) {
		srv, _ := connPair(t)
		if r := newPollingReader(srv, 0); r != io.Reader(srv) {
			t.Errorf("reader %T, want the connection", r)
		}
	})
}

// TestPollingOnOneCPU: a process that may run on one CPU only does not poll
// (what it waits for needs that CPU); with more, it does.
func TestPollingOnOneCPU(t *testing.T) {
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(os.Getpid(), &all); err != nil {
		t.Skipf("no CPU mask: %v", err)
	}
	srv, _ := connPair(t)
	if all.Count() > 1 {
		if _, ok := newPollingReader(srv, time.Millisecond).(*pollingReader); !ok {
			t.Errorf("not polling with %d CPUs", all.Count())
		}
	}
	one := unix.CPUSet{}
	for c := range 1024 {
		if all.IsSet(c) {
			one.Set(c)
			break
		}
	}
	if err := unix.SchedSetaffinity(os.Getpid(), &one); err != nil {
		t.Skipf("cannot confine the process: %v", err)
	}
	defer func() {
		if err := unix.SchedSetaffinity(os.Getpid(), &all); err != nil {
			t.Fatalf("restoring the CPU mask: %v", err)
		}
	}()
	if r := newPollingReader(srv, time.Millisecond); r != io.Reader(srv) {
		t.Errorf("reader %T on one CPU, want the connection itself", r)
	}
}

// TestUnixPollingStops: a connection polling for its next request (a poll
// time far longer than the test) does not hold up the transport's stop, and
// its requests are served as without polling.
func TestUnixPollingStops(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "s.sock")
	ep, err := Open("unix://"+path, zap.NewNop(), nil, Options{Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	stop := startServing(t, ep, &stubHandler{}, path)
	c := dialUnix(t, path, []byte("S-poller"))
	for i := range 20 {
		c.frame(envelope(t, Version, "ping", uint64(i+1), nil))
		if r := c.mustReply(); !r.OK || r.ID != uint64(i+1) {
			t.Fatalf("reply %d: %+v", i, r)
		}
	}
	start := time.Now()
	stop() // fails the test if Serve takes over 5 s
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("stop took %v with a connection polling", d)
	}
}
