package fdlimit

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

func TestChoose(t *testing.T) {
	for _, tc := range []struct {
		noFile                  uint64
		mapCount                int
		reserve, segs, per, con int
	}{
		{noFile: 256, mapCount: 65530, reserve: 64, segs: 96, per: 24, con: 96},
		{noFile: 1024, mapCount: 65530, reserve: 256, segs: 384, per: 96, con: 384},
		{noFile: 20000, mapCount: 65530, reserve: 4096, segs: 7952, per: 1988, con: 4096},
		{noFile: 1 << 20, mapCount: 65530, reserve: 4096, segs: 32765, per: 8191, con: 4096},
		{noFile: 1 << 20, mapCount: 0, reserve: 4096, segs: 522240, per: 130560, con: 4096},
		{noFile: ^uint64(0), mapCount: 65530, reserve: 4096, segs: 32765, per: 8191, con: 4096},
		{noFile: 16, mapCount: 65530, reserve: 32, segs: 1, per: 1, con: 1},
	} {
		t.Run(fmt.Sprint(tc.noFile), func(t *testing.T) {
			l := Choose(tc.noFile, tc.mapCount)
			if l.Reserve != tc.reserve || l.Segments != tc.segs || l.SessionSegments != tc.per || l.Conns != tc.con {
				t.Fatalf("Choose(%d, %d) = reserve %d, segments %d (%d a session), conns %d; want %d, %d (%d), %d",
					tc.noFile, tc.mapCount, l.Reserve, l.Segments, l.SessionSegments, l.Conns, tc.reserve, tc.segs, tc.per, tc.con)
			}
			if n := tc.noFile; n >= 256 && n < maxNoFile && uint64(l.Reserve+l.Segments+l.Conns) > n {
				t.Fatalf("shares %d+%d+%d pass the limit %d", l.Reserve, l.Segments, l.Conns, n)
			}
		})
	}
}

// TestGoRaisesNoFile checks that a Go program started with a soft
// RLIMIT_NOFILE below the hard one runs with the hard one (the Go runtime
// raises it), which is what Read reports: it re-runs this test binary under
// prlimit with a soft limit of 64.
func TestGoRaisesNoFile(t *testing.T) {
	if os.Getenv("FDLIMIT_CHILD") == "1" {
		l, err := Read()
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("soft=%d hard=%d\n", l.NoFile, l.NoFileMax)
		return
	}
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		t.Fatal(err)
	}
	if r.Max <= 64 {
		t.Skipf("hard RLIMIT_NOFILE %d: nothing to raise", r.Max)
	}
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("no prlimit")
	}
	cmd := exec.Command(prlimit, fmt.Sprintf("--nofile=64:%d", r.Max), "--", os.Args[0], "-test.run=^TestGoRaisesNoFile$", "-test.v")
	cmd.Env = append(os.Environ(), "FDLIMIT_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	// package syscall's init sets the soft limit to hard-1 (to notice a
	// later prlimit from outside), which is what the parent runs with too.
	if want := fmt.Sprintf("soft=%d hard=%d", r.Max-1, r.Max); !strings.Contains(string(out), want) {
		t.Fatalf("child started with soft limit 64 reports %q, want %q", out, want)
	}
}
