package ipc

import (
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Polling for the next request, while requests come in quick succession.
//
// A serving thread that sleeps until the next request is woken through its
// CPU, and on virtual machines whose idle CPUs halt that wake-up costs tens
// of microseconds (docs/benchmarks.md, "Placement"); a thread that polls
// finds the request the moment it lands. Polling costs a core for as long as
// it lasts, so it is only done while it pays: while each wait for a request
// ended within the poll time (a client calling in a loop), the next wait
// first polls for up to the poll time, then sleeps. Once a wait lasts longer
// (a client that computes between requests, as a training step does between
// layers) the next one sleeps at once, so such a client costs the server no
// polling at all, until a wait again ends within the poll time.
//
// Only the unix:// transport polls. With ZeroMQ each message also passes
// libzmq's I/O threads in both processes, which sleep in epoll whatever the
// caller does; polling in sonard's loop and in the client left a ping's
// round trip where it was with a 50 us poll time (110-116 us p50 against
// 110-112), and made it slower with 200-300 us (129-162 against 129-133),
// the two pollers taking the two cores from the four I/O threads (a trial of
// 2026-12-05).

// pollRule decides whether a wait polls first (a zero poll time never does).
type pollRule struct {
	poll time.Duration
	cold bool // the last wait lasted longer than poll
}

// until is when a wait beginning at start stops polling; zero: it does not
// poll.
func (r *pollRule) until(start time.Time) time.Time {
	if r.poll <= 0 || r.cold {
		return time.Time{}
	}
	return start.Add(r.poll)
}

// ended records that the wait begun at start has ended (something came).
func (r *pollRule) ended(start time.Time) {
	r.cold = time.Since(start) > r.poll
}

// pollingReader reads one unix:// connection's socket for its goroutine,
// polling by pollRule before Go's network poller puts it to sleep. Closing
// the connection's reading side (stop's CloseRead) ends a poll at once: the
// read finds the end of the stream.
type pollingReader struct {
	raw   syscall.RawConn
	rule  pollRule
	empty int // reads that found nothing: one a sleeping wait, many a poll
}

// newPollingReader reads c, polling for up to poll while requests come that
// quickly; with no poll time, no descriptor to be had, or a process that may
// run on one CPU only, c is read as it is.
func newPollingReader(c *net.UnixConn, poll time.Duration) io.Reader {
	if poll <= 0 || !severalCPUs() {
		return c
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return c
	}
	return &pollingReader{raw: raw, rule: pollRule{poll: poll}}
}

// severalCPUs: this process may run on more than one CPU. Polling only
// helps where the client can send on another CPU meanwhile; confined to one
// (taskset, or a private sonard started by a confined trainer, whose mask
// it inherits) a poll only delays the client it waits for: a ping over
// unix:// took 33-43 us p50 polling and yielding, 86 polling without
// yielding, and 32-34 sleeping (a trial of 2026-12-05).
func severalCPUs() bool {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(os.Getpid(), &set); err != nil {
		return true
	}
	return set.Count() > 1
}

func (r *pollingReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	start := time.Now()
	until := r.rule.until(start)
	var n int
	var rerr error
	err := r.raw.Read(func(fd uintptr) bool {
		for {
			n, rerr = unix.Read(int(fd), p)
			switch {
			case rerr == unix.EINTR:
				continue
			case rerr != unix.EAGAIN:
				return true
			}
			r.empty++
			switch {
			case !until.IsZero() && time.Now().Before(until):
				// Give the CPU to any thread waiting for it (the client's,
				// if it shares this CPU) before the next read.
				_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
				continue
			}
			until = time.Time{} // the poller calls again once the socket is readable
			return false
		}
	})
	r.rule.ended(start)
	switch {
	case err != nil:
		return 0, err
	case rerr != nil:
		return 0, &net.OpError{Op: "read", Net: "unix", Err: rerr}
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}
