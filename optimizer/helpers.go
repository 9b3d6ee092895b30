package optimizer

import (
	"sync/atomic"
	"time"
)

// The goroutines that take parallel's chunks beside its caller, and how the
// caller waits for them.
//
// Starting a goroutine that runs on the other core costs little on a bare
// machine, but on a virtual CPU that halts when idle it took 75-90 us here
// (p50, 2026-12-02: the Go scheduler wakes a parked thread, whose CPU must
// first leave the halt), and waking a caller blocked on a channel costs as
// much again: two workers ran a 614K-element float32 step in 310 us against
// 339 for one (BenchmarkParallelCaller). So:
//
//   - a helper that finds no chunk left does not exit at once: it polls the
//     engine's job slot for the engine's spin time and takes the next job
//     published there (the next tensor of a request comes within
//     microseconds);
//   - Prewake starts helpers ahead of a job (sonard's CPU backend calls it
//     when a step request comes in, before it reads the gradient), so that
//     they are running when the arithmetic starts;
//   - the caller, once no chunk is left to take, polls the count of finished
//     chunks for up to the spin time before it blocks (the helpers' last
//     chunks end within a chunk's time of its own).
//
// A helper started for a job is woken on a CPU the kernel chooses, and on
// such a virtual machine a halted CPU reads as preempted and is passed over:
// after an idle gap the helper was queued on its publisher's own CPU, where
// the caller takes chunks, so the two workers shared one core. With
// Engine.Steer, a helper takes its publisher's CPU out of its thread's mask
// for as long as it runs (and puts the mask back before it exits): a
// 614K-element step after 40 ms idle, two workers, 563-589 us against
// 671-754 and in another run 682-756 against 926-1103
// (BenchmarkApplyAfterIdle), and in GraniteMoe training sonard's step of a
// layer 609-1130 us p50 against 1023-1823 (2026-12-05).
//
// Polling is bounded by the spin time (Engine.Spin, default helperSpin) per
// job; a negative spin turns it off (helpers exit when they find no chunk,
// the caller blocks at once, Prewake starts nothing): the engine before
// 2026-12-02.
//
// A job is published by storing it in the slot, then counting the live
// helpers and starting the missing ones; a helper about to exit leaves the
// count first, then looks at the slot once more. Whatever the interleaving,
// a published job is seen by a live helper or a helper is started for it.
// Correctness never depends on helpers: the caller takes chunks itself until
// none is left (parallel), so a job no helper saw is merely slower.
type helperPool struct {
	job     atomic.Pointer[job] // the job helpers take chunks of; nil when none
	alive   atomic.Int32        // helpers running or polling
	started atomic.Int64        // helpers started so far
	spin    atomic.Int64        // how long an idle helper polls, in ns (the last publisher's)
	steer   atomic.Bool         // helpers keep off the publisher's CPU (Engine.Steer)
	cpu     atomic.Int32        // the last publisher's CPU, with steer
}

// job is one parallel call's work: take chunks until none is left.
type job struct{ work func() }

// helperSpin is the default time an idle helper polls for the next job, and
// the caller for the helpers' last chunks: above the gap between two
// tensors of a request, well below a training step's gap between requests.
const helperSpin = 50 * time.Microsecond

// spin is e's polling time (0 when turned off).
func (e *Engine) spin() time.Duration {
	switch {
	case e.Spin < 0:
		return 0
	case e.Spin == 0:
		return helperSpin
	}
	return e.Spin
}

// publish offers j (nil: none yet) to the helpers and makes sure that n of
// them run.
func (p *helperPool) publish(j *job, n int, spin time.Duration, steer bool) {
	p.spin.Store(int64(spin))
	p.steer.Store(steer)
	if steer {
		p.cpu.Store(int32(currentCPU()))
	}
	if j != nil {
		p.job.Store(j)
	}
	for range n - int(p.alive.Load()) {
		p.alive.Add(1)
		p.started.Add(1)
		go p.help()
	}
}

// retire clears the slot once j is done, so that its closure (and the
// buffers it references) is not kept alive until the next job.
func (p *helperPool) retire(j *job) { p.job.CompareAndSwap(j, nil) }

// help runs the jobs it finds in the slot until it has polled for the spin
// time without finding a new one.
func (p *helperPool) help() {
	if p.steer.Load() {
		defer awayFrom(int(p.cpu.Load()))()
	}
	var last *job
	idle := time.Now()
	for i := 0; ; i++ {
		if j := p.job.Load(); j != nil && j != last {
			last = j
			j.work()
			idle = time.Now()
			continue
		}
		if i&15 != 0 || time.Since(idle) < time.Duration(p.spin.Load()) {
			continue
		}
		p.alive.Add(-1)
		// A job published before the count dropped may have been counted on
		// this helper: take it.
		if j := p.job.Load(); j != nil && j != last {
			p.alive.Add(1)
			continue
		}
		return
	}
}

// await returns once done reaches chunks: polling for up to spin, then
// blocked on finished (closed by whoever finishes the last chunk).
func await(done *atomic.Int64, chunks int64, finished <-chan struct{}, spin time.Duration) {
	start := time.Now()
	for i := 0; done.Load() < chunks; i++ {
		if i&15 == 15 && time.Since(start) >= spin {
			<-finished
			return
		}
	}
}

// Prewake starts the helpers a step of a tensor of n elements on this
// engine will use, so that they are running when its arithmetic starts
// instead of being woken then (tens of microseconds on a virtual CPU that
// halts when idle). It starts none for a tensor that one worker updates
// alone (per-expert requests, tiny steps), where a helper's polling would
// only take a core from other threads, and costs at most the spin time of
// polling per helper when no step follows.
func (e *Engine) Prewake(n int) {
	if e.CallerWaits || e.spin() == 0 {
		return
	}
	if h := e.helpersFor(n); h > 0 {
		e.helpers.publish(nil, h, e.spin(), e.Steer)
	}
}

// helpersFor is how many helpers parallel uses beside its caller for n
// elements: one fewer than the workers, or than the chunks where those are
// fewer.
func (e *Engine) helpersFor(n int) int {
	w, chunk := e.split(n)
	if w <= 1 {
		return 0
	}
	return min(w, (n+chunk-1)/chunk) - 1
}
