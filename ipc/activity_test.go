package ipc

import (
	"testing"
	"time"
)

func TestActivityWait(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		name      string
		last      time.Time // zero: nothing received yet
		yielded   time.Time
		now       time.Time
		longest   time.Duration
		want      time.Duration
		wantYield bool
	}{
		{"nothing received yet", time.Time{}, time.Time{}, t0, 100 * time.Millisecond, 100 * time.Millisecond, false},
		{"just received", t0, time.Time{}, t0, 100 * time.Millisecond, activeWait, true},
		{"received within activeFor", t0, time.Time{}, t0.Add(activeFor - time.Millisecond), 100 * time.Millisecond, activeWait, true},
		{"silent for activeFor", t0, time.Time{}, t0.Add(activeFor), 100 * time.Millisecond, 100 * time.Millisecond, false},
		{"a shorter longest is kept", t0, time.Time{}, t0.Add(time.Millisecond), 2 * time.Millisecond, 2 * time.Millisecond, true},
		{"no wait stays no wait", t0, time.Time{}, t0, 0, 0, true},
		{"yielded just now: no yield", t0, t0, t0.Add(time.Millisecond), time.Second, activeWait, false},
		{"yielded yieldEvery ago: yield", t0, t0, t0.Add(yieldEvery), time.Second, activeWait, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := activity{last: c.last, yielded: c.yielded}
			got, yield := a.wait(c.now, c.longest)
			if got != c.want || yield != c.wantYield {
				t.Fatalf("wait = %v, %v; want %v, %v", got, yield, c.want, c.wantYield)
			}
		})
	}
	// The active wait and the yield period must stay below the 10 ms after
	// which the runtime takes a P from a goroutine in a system call, or from
	// one not rescheduled (activity.go).
	if activeWait >= 10*time.Millisecond || yieldEvery+activeWait >= 10*time.Millisecond {
		t.Fatalf("activeWait %v, yieldEvery %v: a goroutine could go 10 ms without a yield", activeWait, yieldEvery)
	}
}

func TestActivitySaw(t *testing.T) {
	var a activity
	now := time.Now()
	a.saw(now)
	if d, yield := a.wait(now.Add(time.Millisecond), time.Second); d != activeWait || !yield {
		t.Fatalf("after saw: wait = %v, %v; want %v, true", d, yield, activeWait)
	}
}
