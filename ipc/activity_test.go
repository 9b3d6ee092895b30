package ipc

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestActivityWait(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	for _, c := range []struct {
		name      string
		last      time.Time // zero: nothing received yet
		yielded   time.Time
		now       time.Time
		longest   time.Duration
		handled   bool
		want      time.Duration
		wantYield bool
	}{
		{"nothing received yet", time.Time{}, time.Time{}, t0, 100 * ms, false, 100 * ms, false},
		{"just received", t0, time.Time{}, t0, 100 * ms, true, yieldEvery, true},
		{"received within activeFor", t0, time.Time{}, t0.Add(activeFor - ms), 100 * ms, false, yieldEvery, true},
		{"silent for activeFor", t0, t0, t0.Add(activeFor), 100 * ms, false, 100 * ms, false},
		{"a shorter longest is kept", t0, time.Time{}, t0.Add(ms), 2 * ms, false, 2 * ms, true},
		{"no wait stays no wait", t0, time.Time{}, t0, 0, false, 0, true},
		{"yielded 1 ms ago: wait until the next yield", t0, t0, t0.Add(ms), time.Second, false, yieldEvery - ms, false},
		{"yielded yieldEvery ago: yield", t0, t0, t0.Add(yieldEvery), time.Second, false, yieldEvery, true},
		{"woke late: yield", t0, t0, t0.Add(yieldEvery + 3*ms), time.Second, false, yieldEvery, true},
		{"half of yieldEvery, nothing handled: no yield", t0, t0, t0.Add(yieldEvery / 2), time.Second, false, yieldEvery / 2, false},
		{"half of yieldEvery after a message: yield", t0, t0, t0.Add(yieldEvery / 2), time.Second, true, yieldEvery, true},
		{"1 ms after a yield, after a message: no yield", t0, t0, t0.Add(ms), time.Second, true, yieldEvery - ms, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := activity{last: c.last, yielded: c.yielded}
			got, yield := a.wait(c.now, c.longest, c.handled)
			if got != c.want || yield != c.wantYield {
				t.Fatalf("wait = %v, %v; want %v, %v", got, yield, c.want, c.wantYield)
			}
		})
	}
	// The yield period must stay below the 10 ms after which the runtime
	// takes a P from a goroutine in a system call, or from one not
	// rescheduled (activity.go).
	if yieldEvery >= 10*time.Millisecond {
		t.Fatalf("yieldEvery %v: a goroutine could go 10 ms without a yield", yieldEvery)
	}
}

// TestActivityNoWaitPastAYield runs the serving loop's rounds on a clock of
// its own, with messages arriving at random and taking random time to
// handle: while clients are active, no wait ever ends later than yieldEvery
// after the last yield (the guarantee the runtime's 10 ms rules need), and
// a quiet stretch costs one wake-up per yieldEvery, not more.
func TestActivityNoWaitPastAYield(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	var a activity
	now := time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC)
	arrival := now
	handled := false
	wakes, quiet := 0, time.Duration(0)
	for range 20000 {
		d, yield := a.wait(now, 100*time.Millisecond, handled)
		if yield {
			a.yielded = now
		}
		active := !a.last.IsZero() && now.Sub(a.last) < activeFor
		if end := now.Add(d); active && end.Sub(a.yielded) > yieldEvery {
			t.Fatalf("at %v: a wait ending %v after the last yield (yieldEvery %v)", now, end.Sub(a.yielded), yieldEvery)
		}
		if end := now.Add(d); arrival.Before(end) || arrival.Equal(end) {
			now = arrival
			a.saw(now)
			now = now.Add(time.Duration(r.IntN(3000)) * time.Microsecond) // handling
			handled = true
			// Mostly a request every few milliseconds, sometimes a pause.
			gap := time.Duration(r.IntN(12000)) * time.Microsecond
			if r.IntN(20) == 0 {
				gap = time.Duration(20+r.IntN(50)) * time.Millisecond
			}
			arrival = now.Add(gap)
			continue
		}
		if active {
			wakes++
			quiet += d
		}
		now = now.Add(d)
		handled = false
	}
	if wakes == 0 {
		t.Fatal("no wake-up without a message: the test did not exercise the quiet case")
	}
	if per := quiet / time.Duration(wakes); per < yieldEvery/4 {
		t.Fatalf("%d wake-ups without a message, one per %v of quiet: more than the yields need", wakes, per)
	}
}

func TestActivitySaw(t *testing.T) {
	var a activity
	now := time.Now()
	a.saw(now)
	if d, yield := a.wait(now.Add(time.Millisecond), time.Second, true); d != yieldEvery || !yield {
		t.Fatalf("after saw: wait = %v, %v; want %v, true", d, yield, yieldEvery)
	}
}
