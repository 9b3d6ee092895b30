package optimizer

import (
	"sync/atomic"
	"time"
)

// Phases sums where an Engine's workers spend an update's time (wall time,
// added over the workers): copying gradients out of another process
// (GradReader) and the AdamW arithmetic. Several engines may share one.
// Safe for concurrent use; the zero value is ready.
type Phases struct {
	readNanos   atomic.Int64
	kernelNanos atomic.Int64
}

// Read is the time spent in GradReader.ReadGrad.
func (p *Phases) Read() time.Duration { return time.Duration(p.readNanos.Load()) }

// Kernel is the time spent in the AdamW arithmetic.
func (p *Phases) Kernel() time.Duration { return time.Duration(p.kernelNanos.Load()) }

// since adds the time since t0 to *c.
func since(c *atomic.Int64, t0 time.Time) { c.Add(int64(time.Since(t0))) }
