//go:build linux

package optimizer

import (
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// threadMasks reads every thread's CPU list of this process from /proc.
func threadMasks(t *testing.T) map[string]string {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, task := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/status")
		if err != nil {
			continue // a thread that exited meanwhile
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
				out[task.Name()] = strings.TrimSpace(v)
			}
		}
	}
	return out
}

// A steered helper works with its publisher's CPU out of its mask and puts
// the mask back before it exits; an unsteered one keeps the full mask.
func TestHelperSteering(t *testing.T) {
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil || all.Count() < 2 {
		t.Skip("needs a CPU mask of two or more CPUs")
	}
	if err := unix.SchedSetaffinity(0, &all); err != nil {
		t.Skipf("cannot set a thread's CPU mask here (%v): steering leaves the masks alone", err)
	}
	for _, tc := range []struct {
		name  string
		steer bool
	}{
		{"steered", true},
		{"not steered", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			before := threadMasks(t)
			var p helperPool
			seen := make(chan unix.CPUSet, 1)
			j := &job{work: func() {
				var m unix.CPUSet
				if err := unix.SchedGetaffinity(0, &m); err != nil {
					t.Error(err)
				}
				seen <- m
			}}
			p.publish(j, 1, time.Millisecond, tc.steer)
			var m unix.CPUSet
			select {
			case m = <-seen:
			case <-time.After(10 * time.Second):
				t.Fatal("no helper took the job")
			}
			if tc.steer {
				publisher := int(p.cpu.Load())
				if publisher < 0 || !all.IsSet(publisher) {
					t.Fatalf("publisher's CPU recorded as %d", publisher)
				}
				if m.IsSet(publisher) || m.Count() != all.Count()-1 {
					t.Fatalf("steered helper's mask %v: want the process's %v without CPU %d", m, all, publisher)
				}
			} else if m != all {
				t.Fatalf("helper's mask %v, want the process's %v", m, all)
			}
			deadline := time.Now().Add(10 * time.Second)
			for p.alive.Load() > 0 {
				if time.Now().After(deadline) {
					t.Fatal("the helper did not exit")
				}
				time.Sleep(time.Millisecond)
			}
			// Once the helper has exited, every thread (the one it ran on
			// included, back in the runtime's pool) has the process's mask.
			want := before[firstTID(before)]
			for range 100 {
				bad := ""
				for tid, mask := range threadMasks(t) {
					if mask != want {
						bad = tid + ": " + mask
					}
				}
				if bad == "" {
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Errorf("a thread's CPU list is not the process's %q: %v", want, threadMasks(t))
		})
	}
}

// firstTID is any thread id of masks (they all had the process's mask before).
func firstTID(masks map[string]string) string {
	for tid := range masks {
		return tid
	}
	return ""
}
