package cpu

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/backend"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"golang.org/x/sys/unix"
)

// clientSegment creates a fully allocated 0600 segment in dir as a client
// does and returns its file (kept open, to truncate it later).
func clientSegment(t *testing.T, dir, name string, size int) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := unix.Fallocate(int(f.Fd()), 0, 0, int64(size)); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestFaultDuringStepIsAnError truncates the gradient's segment after the
// server resolved it (as a client racing the server could) and steps: the
// SIGBUS in the engine's workers (assembly kernels and copies) becomes an
// error naming the tensor and the segment; the tensor is marked damaged and
// refuses steps and exports until an import replaces its state.
func TestFaultDuringStepIsAnError(t *testing.T) {
	const numel = 1 << 16 // several workers' chunks
	for _, tc := range []struct {
		name    string
		dtype   optimizer.DType
		fused   bool
		apply   bool
		partial bool
	}{
		{"apply float32", optimizer.Float32, false, true, true},
		{"apply bfloat16", optimizer.BFloat16, false, true, true},
		{"apply float32 fused", optimizer.Float32, true, true, true},
		{"accumulate first micro-batch", optimizer.Float32, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			b := &Backend{Mapper: ipcbridge.ShmMapper{Dir: dir, Unlink: true}, Workers: 4, MinChunk: 1024}
			bs, err := b.Open(backend.Client{Name: "c"})
			if err != nil {
				t.Fatal(err)
			}
			defer bs.Close()
			clientSegment(t, dir, "sonar-p", 4*numel)
			gf := clientSegment(t, dir, "sonar-g", 4*numel)
			pseg, err := bs.Attach([]byte("sonar-p"), 4*numel)
			if err != nil {
				t.Fatal(err)
			}
			gseg, err := bs.Attach([]byte("sonar-g"), 4*numel)
			if err != nil {
				t.Fatal(err)
			}
			param, _ := backend.Resolve(pseg, 0, 4*numel, 4)
			grad, _ := backend.Resolve(gseg, 0, 4*numel, 4)
			h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
			nb := int64(numel * tc.dtype.Size())
			param, _ = backend.Resolve(pseg, 0, nb, 4)
			grad, _ = backend.Resolve(gseg, 0, nb, 4)
			ts, err := bs.Create([]backend.Spec{{Name: "w", DType: tc.dtype, Numel: numel, Hyper: h, Param: param}})
			if err != nil {
				t.Fatal(err)
			}
			tn := ts[0]
			sc := func(k int64) optimizer.Scalars {
				s := optimizer.ScalarsFor(h, k)
				s.Fused = tc.fused
				return s
			}
			step := []backend.Item{{Tensor: tn, Grad: &grad, Apply: true, Scalars: sc(1)}}
			if err := bs.Step(step, false); err != nil {
				t.Fatal(err)
			}
			// The client shrinks the gradient's file to one page.
			if err := gf.Truncate(4096); err != nil {
				t.Fatal(err)
			}
			if err := gseg.Verify(); err == nil || !strings.Contains(err.Error(), "truncated") {
				t.Fatalf("Verify after truncate: %v", err)
			}
			items := []backend.Item{{Tensor: tn, Grad: &grad, Apply: tc.apply, Scalars: sc(2)}}
			err = bs.Step(items, false)
			var fe *optimizer.FaultError
			if !errors.As(err, &fe) {
				t.Fatalf("step over a truncated segment: %v, want a fault error", err)
			}
			for _, want := range []string{"memory fault", `"w"`, "sonar-g", "truncated to 4096 bytes"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
			if fe.Partial != tc.partial || (tn.Damage() != nil) != tc.partial {
				t.Fatalf("partial %v damage %v, want partial %v", fe.Partial, tn.Damage(), tc.partial)
			}
			if tn.Pending() != 0 || tn.Step() != 1 {
				t.Fatalf("pending %d step %d after the fault, want 0 and 1", tn.Pending(), tn.Step())
			}
			if !tc.partial {
				return
			}
			if err := bs.Step(step, false); err == nil || !strings.Contains(err.Error(), "damaged") {
				t.Fatalf("a damaged tensor stepped: %v", err)
			}
			// An import (from intact memory) replaces the state and clears the mark.
			clientSegment(t, dir, "sonar-x", 8*numel)
			xseg, err := bs.Attach([]byte("sonar-x"), 8*numel)
			if err != nil {
				t.Fatal(err)
			}
			m, _ := backend.Resolve(xseg, 0, nb, 4)
			v, _ := backend.Resolve(xseg, 4*numel, nb, 4)
			if err := bs.Import(tn, 1, []backend.Ref{m, v}); err != nil {
				t.Fatal(err)
			}
			if tn.Damage() != nil {
				t.Fatal("import did not clear the damage")
			}
			if err := bs.Export(tn, []backend.Ref{m, v}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAttachRefusesSparseSegment: a segment whose pages are not all
// allocated could fault on first touch when /dev/shm is full.
func TestAttachRefusesSparseSegment(t *testing.T) {
	dir := t.TempDir()
	f, err := os.OpenFile(filepath.Join(dir, "sonar-sparse"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(1 << 20); err != nil {
		t.Fatal(err)
	}
	bs, _ := New(ipcbridge.ShmMapper{Dir: dir}, 1).Open(backend.Client{})
	defer bs.Close()
	_, err = bs.Attach([]byte("sonar-sparse"), 1<<20)
	if err == nil || !strings.Contains(err.Error(), "posix_fallocate") {
		t.Fatalf("sparse segment attached: %v", err)
	}
}

// TestDetachedSegmentsAreForgotten attaches and closes (detaches) segments in
// several orders: the session keeps only the segments still attached, so a
// client cycling attach and detach does not grow the server.
func TestDetachedSegmentsAreForgotten(t *testing.T) {
	for _, tc := range []struct {
		name   string
		attach int
		detach []int // indexes of the attached segments to close, in order
		want   int   // segments the session still holds
	}{
		{"none detached", 3, nil, 3},
		{"all detached in order", 3, []int{0, 1, 2}, 0},
		{"all detached in reverse", 3, []int{2, 1, 0}, 0},
		{"middle one", 3, []int{1}, 2},
		{"detached twice", 2, []int{0, 0}, 1},
		{"many cycles", 200, seq(200), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			bs, err := New(ipcbridge.ShmMapper{Dir: dir, Unlink: true}, 1).Open(backend.Client{})
			if err != nil {
				t.Fatal(err)
			}
			defer bs.Close()
			var segs []backend.Segment
			for i := 0; i < tc.attach; i++ {
				name := "sonar-cycle-" + strconv.Itoa(i)
				clientSegment(t, dir, name, 4096)
				seg, err := bs.Attach([]byte(name), 4096)
				if err != nil {
					t.Fatal(err)
				}
				segs = append(segs, seg)
			}
			for _, i := range tc.detach {
				if err := segs[i].Close(); err != nil {
					t.Fatal(err)
				}
			}
			if got := len(bs.(*session).segments); got != tc.want {
				t.Fatalf("session holds %d segments, want %d", got, tc.want)
			}
			if err := bs.Close(); err != nil {
				t.Fatal(err)
			}
			if got := len(bs.(*session).segments); got != 0 {
				t.Fatalf("closed session holds %d segments", got)
			}
		})
	}
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}
