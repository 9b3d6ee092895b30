package vml

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// venvTorchLib is where the repository's virtual environment keeps torch's
// CPU library, relative to the repository root.
const venvTorchLib = ".venv/lib/python3.11/site-packages/torch/lib"

// torchLibDir returns the directory of libtorch_cpu.so: that of
// $SONAR_TORCH_LIB, else the repository's venv (found by walking up from
// the test's working directory to go.mod). It skips the test when absent.
func torchLibDir(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SONAR_TORCH_LIB"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("SONAR_TORCH_LIB=%s: %v", p, err)
		}
		return filepath.Dir(p)
	}
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Skip("repository root (go.mod) not found")
		}
		dir = parent
	}
	lib := filepath.Join(dir, venvTorchLib)
	if _, err := os.Stat(filepath.Join(lib, "libtorch_cpu.so")); err != nil {
		t.Skipf("no libtorch_cpu.so (set SONAR_TORCH_LIB or create the venv): %v", err)
	}
	return lib
}

func torchLib(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SONAR_TORCH_LIB"); p != "" {
		torchLibDir(t)
		return p
	}
	return filepath.Join(torchLibDir(t), "libtorch_cpu.so")
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	text := filepath.Join(dir, "not-a-library.so")
	if err := os.WriteFile(text, []byte("this is not an ELF file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.so")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ name, path string }{
		{"nonexistent", filepath.Join(dir, "missing.so")},
		{"empty path", ""},
		{"text file", text},
		{"empty file", empty},
		{"directory", dir},
	}
	for _, tc := range cases {
		s, err := Load(tc.path)
		if err == nil || s != nil {
			t.Errorf("%s: Load(%q) = %v, %v; want an error", tc.name, tc.path, s, err)
		}
	}
	// A failed load is not cached: the same path fails again.
	if _, err := Load(text); err == nil {
		t.Error("second Load of a text file succeeded")
	}
}

func TestLoadLibraryWithoutVmsSqrt(t *testing.T) {
	lib := filepath.Join(torchLibDir(t), "libc10.so")
	if _, err := os.Stat(lib); err != nil {
		t.Skip("no libc10.so next to libtorch_cpu.so")
	}
	if _, err := Load(lib); err == nil {
		t.Errorf("Load(%s) succeeded, but it does not export vmsSqrt", filepath.Base(lib))
	}
}

func ulpDiff(a, b float32) int64 {
	return int64(math.Float32bits(a)) - int64(math.Float32bits(b))
}

func TestApplyWithinOneULP(t *testing.T) {
	s, err := Load(torchLib(t))
	if err != nil {
		t.Fatal(err)
	}
	if s2, err := Load(s.Path); err != nil || s2 != s {
		t.Errorf("second Load: %p, %v; want the cached %p", s2, err, s)
	}
	r := rand.New(rand.NewPCG(1, 2))
	total, below := 0, 0
	for _, n := range []int{1, 7, 1000, 100000} {
		src := make([]float32, n)
		for i := range src {
			switch i % 4 {
			case 0: // any positive finite float, subnormals included
				src[i] = math.Float32frombits(r.Uint32N(0x7F800000))
			case 1: // exp_avg_sq-like values
				x := r.NormFloat64() * 1e-3
				src[i] = float32(x * x)
			default:
				src[i] = float32(r.Float64() * 4)
			}
		}
		const guard = 3
		dst := make([]float32, n+guard)
		for i := n; i < len(dst); i++ {
			dst[i] = -1
		}
		srcCopy := append([]float32(nil), src...)
		s.Apply(dst, src)
		for i := range src {
			if src[i] != srcCopy[i] {
				t.Fatalf("n=%d: Apply changed src[%d]", n, i)
			}
			want := float32(math.Sqrt(float64(src[i]))) // correctly rounded
			d := ulpDiff(dst[i], want)
			if d < -1 || d > 1 {
				t.Fatalf("n=%d: sqrt(%g) = %g, IEEE %g: %d ulps apart", n, src[i], dst[i], want, d)
			}
			total++
			if d != 0 {
				below++
			}
		}
		for i := n; i < len(dst); i++ {
			if dst[i] != -1 {
				t.Fatalf("n=%d: Apply wrote dst[%d] past len(src)", n, i)
			}
		}
	}
	t.Logf("%s: %d of %d results differ from IEEE sqrt by one ulp", filepath.Base(s.Path), below, total)

	// Exact cases.
	src := []float32{0, 1, 4, 0.25, 1 << 20, float32(math.Inf(1))}
	dst := make([]float32, len(src))
	s.Apply(dst, src)
	for i, x := range src {
		if want := float32(math.Sqrt(float64(x))); dst[i] != want {
			t.Errorf("sqrt(%g) = %g, want %g", x, dst[i], want)
		}
	}
	s.Apply(nil, nil) // empty input: nothing to do, no panic
}
