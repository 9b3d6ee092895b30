package ipc

import (
	"runtime"
	"time"
)

// Short waits while clients are active.
//
// The ZeroMQ transport's goroutine waits for the next request in one long
// blocking cgo call (zmq_poll), and that wakes Go's runtime monitor thread
// (sysmon) again and again. sysmon sleeps 20 us at a time after it last
// found work, and doubles that only after 50 rounds without any (up to
// 10 ms). Two things keep resetting it to 20 us:
//   - it takes the processor (P) of a goroutine that has been in one system
//     call or cgo call for 10 ms (or whose goroutine has not been rescheduled
//     for 10 ms), and
//   - once every P is idle it sleeps until woken, and the next system call
//     wakes it (the runtime's syscall wake-up), which counts as work.
//
// Each request of a training step then restarted a millisecond or more of
// 20 us rounds. On the 2-vCPU virtual machines here, whose idle vCPUs halt,
// a round costs its thread about 20 us of CPU: in a GraniteMoe training run
// sysmon woke about 2,000 times a second and took a quarter of sonard's CPU
// time (docs/benchmarks.md, "sonard's waits between requests").
//
// So while a client has sent something in the last activeFor, the loop
// waits at most activeWait per call and yields (runtime.Gosched) at least
// every yieldEvery: its P stays busy in a call that is never 10 ms old, its
// goroutine is rescheduled every few milliseconds, no P goes idle, and
// sysmon finds nothing to do and backs off to its 10 ms period (about 100
// wake-ups a second, against 2,000). When clients fall silent for
// activeFor, the waits go back to the caller's longest, so an idle server
// wakes as rarely as before.
//
// The unix:// transport does not use this: each connection has its own
// goroutine, waiting in Go's network poller. Waiting in a system call
// instead would make each of them hold a P, which another connection's
// update workers then lack, and a thread asleep in a system call answered a
// back-to-back request later than the network poller (a ping's p50 44-49 us
// against 20-24 in a trial of 2026-12-02). A connection whose requests come
// in quick succession holds its P for at most the poll time before it waits
// there (pollingReader, unixpoll.go), yielding its CPU between reads.
const (
	activeFor  = time.Second
	activeWait = 5 * time.Millisecond
	yieldEvery = 2 * time.Millisecond
)

// activity remembers when a serving goroutine last received something, and
// when it last yielded.
type activity struct{ last, yielded time.Time }

// saw records that a message arrived at now.
func (a *activity) saw(now time.Time) { a.last = now }

// wait returns how long the next blocking wait may last, at most longest,
// and whether the goroutine should yield before it: while active, once
// every yieldEvery (a yield costs a trip through the scheduler, which may
// wake another thread, so not before every request of a quick exchange).
func (a *activity) wait(now time.Time, longest time.Duration) (time.Duration, bool) {
	if !a.last.IsZero() && now.Sub(a.last) < activeFor {
		return min(longest, activeWait), now.Sub(a.yielded) >= yieldEvery
	}
	return longest, false
}

// before is wait with the yield done: call it right before the blocking
// call and wait at most what it returns.
func (a *activity) before(longest time.Duration) time.Duration {
	now := time.Now()
	d, yield := a.wait(now, longest)
	if yield {
		a.yielded = now
		runtime.Gosched()
	}
	return d
}
