package optimizer

import (
	"sync/atomic"
	"time"
)

// Phases sums where an update's time goes (wall time, added over the
// workers): proving a client's gradient readable before it (the caller's
// check, AddCheck), copying gradients out of another process (GradReader)
// and the AdamW arithmetic, both timed by the Engine. Several engines may
// share one. Safe for concurrent use; the zero value is ready.
type Phases struct {
	checkNanos  atomic.Int64
	readNanos   atomic.Int64
	kernelNanos atomic.Int64
}

// AddCheck adds the time since t0 to the check's.
func (p *Phases) AddCheck(t0 time.Time) { since(&p.checkNanos, t0) }

// Check is the time added by AddCheck.
func (p *Phases) Check() time.Duration { return time.Duration(p.checkNanos.Load()) }

// Read is the time spent in GradReader.ReadGrad.
func (p *Phases) Read() time.Duration { return time.Duration(p.readNanos.Load()) }

// Kernel is the time spent in the AdamW arithmetic.
func (p *Phases) Kernel() time.Duration { return time.Duration(p.kernelNanos.Load()) }

// since adds the time since t0 to *c.
func since(c *atomic.Int64, t0 time.Time) { c.Add(int64(time.Since(t0))) }
