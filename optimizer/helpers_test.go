package optimizer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// waitIdle waits until e has no live helper, failing after a second.
func waitIdle(t *testing.T, e *Engine) {
	t.Helper()
	deadline := time.Now().Add(time.Second)
	for e.helpers.alive.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d helpers still alive a second after the last job", e.helpers.alive.Load())
		}
		time.Sleep(time.Millisecond)
	}
}

// TestHelpersExitWhenIdle: helpers started by jobs or by Prewake end once
// they have polled the spin time without a job; with the spin turned off
// Prewake starts none.
func TestHelpersExitWhenIdle(t *testing.T) {
	for _, tc := range []struct {
		name string
		e    *Engine
	}{
		{"default spin", &Engine{Workers: 4, MinChunk: 1}},
		{"long spin", &Engine{Workers: 2, MinChunk: 1, Spin: 20 * time.Millisecond}},
		{"spin off", &Engine{Workers: 3, MinChunk: 1, Spin: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 20 {
				if err := tc.e.parallel(100003, func(lo, hi int) {}); err != nil {
					t.Fatal(err)
				}
			}
			waitIdle(t, tc.e)
			// Counted as started, not alive: under load a helper may poll its
			// 50 us and leave before the check.
			before := tc.e.helpers.started.Load()
			tc.e.Prewake(1 << 10) // one worker's tensor: no helper
			if got := tc.e.helpers.started.Load() - before; got != 0 {
				t.Fatalf("Prewake for a one-worker tensor started %d helpers", got)
			}
			tc.e.Prewake(1 << 20)
			if got := tc.e.helpers.started.Load() - before; tc.e.Spin < 0 && got != 0 {
				t.Fatalf("Prewake with the spin off started %d helpers", got)
			} else if tc.e.Spin >= 0 && got != int64(tc.e.Workers-1) {
				t.Fatalf("Prewake started %d helpers, want %d", got, tc.e.Workers-1)
			}
			waitIdle(t, tc.e)
		})
	}
}

// TestHelpersTakeChunks: the helper started for one job is still polling
// when the next comes (a spin of seconds, so that no load of the machine
// can outlast it) and takes a chunk of it: no second helper is started. The
// caller's first chunk of each job waits for a chunk run elsewhere, so the
// test does not depend on timing. A helper Prewake starts takes the chunks
// of the job that follows it the same way.
func TestHelpersTakeChunks(t *testing.T) {
	run := func(e *Engine) {
		var helped atomic.Bool
		took := make(chan struct{})
		var once sync.Once
		id := goid()
		if err := e.parallel(1<<17, func(lo, hi int) {
			if goid() != id {
				helped.Store(true)
				once.Do(func() { close(took) })
				return
			}
			if lo == 0 {
				select {
				case <-took:
				case <-time.After(10 * time.Second):
				}
			}
		}); err != nil {
			t.Fatal(err)
		}
		if !helped.Load() {
			t.Fatal("no helper took a chunk")
		}
	}
	e := &Engine{Workers: 2, MinChunk: 1, Spin: 3 * time.Second}
	run(e)
	run(e)
	if got := e.helpers.started.Load(); got != 1 {
		t.Fatalf("%d helpers started for two jobs in a row, want 1 (the first one's, still polling)", got)
	}
	w := &Engine{Workers: 2, MinChunk: 1, Spin: 3 * time.Second}
	w.Prewake(1 << 17)
	run(w)
	if got := w.helpers.started.Load(); got != 1 {
		t.Fatalf("%d helpers started by Prewake and a job, want 1", got)
	}
	for _, x := range []*Engine{e, w} { // end the polling now
		x.helpers.spin.Store(0)
		waitIdle(t, x)
	}
}

// goid identifies the calling goroutine (the number in its stack trace).
func goid() string {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = b[len("goroutine "):]
	return string(b[:bytes.IndexByte(b, ' ')])
}

// TestParallelConcurrentCallers: callers on one engine publish over each
// other's jobs; every call still covers its range exactly once and returns
// (run with -race).
func TestParallelConcurrentCallers(t *testing.T) {
	e := &Engine{Workers: 3, MinChunk: 1}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for c := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(c), 1))
			for range 50 {
				n := 1 + r.IntN(200000)
				hits := make([]int32, n)
				if err := e.parallel(n, func(lo, hi int) {
					for i := lo; i < hi; i++ {
						hits[i]++ // chunks are disjoint
					}
				}); err != nil {
					errs <- err
					return
				}
				for i, h := range hits {
					if h != 1 {
						errs <- fmt.Errorf("caller %d, n=%d: element %d visited %d times", c, n, i, h)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	waitIdle(t, e)
}

// TestParallelAcrossSpinGaps: jobs that come just before, at and after the
// end of the helpers' spin (the race between a helper leaving and a job
// counted on it) are all done, none hangs.
func TestParallelAcrossSpinGaps(t *testing.T) {
	for _, spin := range []time.Duration{20 * time.Microsecond, helperSpin} {
		e := &Engine{Workers: 2, MinChunk: 1, Spin: spin}
		r := rand.New(rand.NewPCG(3, 4))
		for k := range 400 {
			gap := time.Duration(r.IntN(int(3 * spin)))
			deadline := time.Now().Add(gap)
			for time.Now().Before(deadline) { // sleep is too coarse
			}
			if k%3 == 0 {
				e.Prewake(150000)
			}
			var elems atomic.Int64
			done := make(chan error, 1)
			go func() {
				done <- e.parallel(150000, func(lo, hi int) { elems.Add(int64(hi - lo)) })
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("spin %v, gap %v: parallel did not return", spin, gap)
			}
			if elems.Load() != 150000 {
				t.Fatalf("spin %v, gap %v: %d of 150000 elements done", spin, gap, elems.Load())
			}
		}
		waitIdle(t, e)
	}
}
