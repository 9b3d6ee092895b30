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
// yields (runtime.Gosched) every yieldEvery and waits at most until its next
// yield: its P stays busy in a call that is never 10 ms old, its goroutine
// is rescheduled every few milliseconds, no P goes idle, and sysmon finds
// nothing to do and backs off to its 10 ms period (about 100 wake-ups a
// second, against 2,000). When clients fall silent for activeFor, the waits
// go back to the caller's longest, so an idle server wakes as rarely as
// before.
//
// Each of those wake-ups takes a CPU from whatever runs there (on a machine
// where the trainer's threads take every core, a thread of the trainer),
// and a yield while the other Ps are idle wakes a second thread of sonard:
// the runtime starts an idle P for the goroutine the yield queued, which the
// yielding thread then runs itself, and the woken thread finds nothing to
// do. A yield right after a step request costs no such wake-up: the
// request's update workers are still polling (optimizer/helpers.go), so no
// P is idle. So the loop yields after it handled a message once
// yieldEvery/2 has passed since its last yield, and otherwise wakes to
// yield only when yieldEvery has passed without one: in a training step
// whose requests come every few milliseconds, only the gaps without
// requests (forward, the dense step) cost wake-ups. Until 2026-12-05 the
// loop woke every 5 ms and yielded at each wake once 2 ms had passed: in
// GraniteMoe training (`perf sched`) two preemptions of the trainer every
// 5 ms.
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
	yieldEvery = 7 * time.Millisecond // 3 ms short of the runtime's 10, for a late wake-up
)

// activity remembers when a serving goroutine last received something, and
// when it last yielded.
type activity struct{ last, yielded time.Time }

// saw records that a message arrived at now.
func (a *activity) saw(now time.Time) { a.last = now }

// wait returns how long the next blocking wait may last, at most longest,
// and whether the goroutine should yield before it (handled: it has just
// handled a message). While active it yields once yieldEvery has passed
// since its last yield, or yieldEvery/2 right after a message, and the wait
// ends when the next yield is due.
func (a *activity) wait(now time.Time, longest time.Duration, handled bool) (time.Duration, bool) {
	if a.last.IsZero() || now.Sub(a.last) >= activeFor {
		return longest, false
	}
	since := now.Sub(a.yielded)
	yield := since >= yieldEvery || handled && since >= yieldEvery/2
	due := yieldEvery - since
	if yield {
		due = yieldEvery
	}
	return max(0, min(longest, due)), yield
}

// before is wait with the yield done: call it right before the blocking
// call and wait at most what it returns.
func (a *activity) before(longest time.Duration, handled bool) time.Duration {
	now := time.Now()
	d, yield := a.wait(now, longest, handled)
	if yield {
		a.yielded = now
		runtime.Gosched()
	}
	return d
}
