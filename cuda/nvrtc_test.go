package cuda

import (
	"errors"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// testNVRTC loads NVRTC from the usual places and, failing that, from the
// repository's virtual environment (torch's CUDA wheels bring
// nvidia-cuda-nvrtc); tests that need it are skipped where there is none.
func testNVRTC(t *testing.T) *NVRTC {
	t.Helper()
	names := NVRTCCandidates()
	venv, _ := filepath.Glob(filepath.Join("..", ".venv", "lib", "python3*", "site-packages", "nvidia", "*", "lib", "libnvrtc.so*"))
	for _, v := range venv {
		if !strings.Contains(filepath.Base(v), "builtins") {
			abs, _ := filepath.Abs(v)
			names = append([]string{abs}, names...)
		}
	}
	nv, err := OpenNVRTCFrom(names)
	if err != nil {
		t.Skipf("no NVRTC on this machine: %v", err)
	}
	return nv
}

func TestNVRTCAbsent(t *testing.T) {
	_, err := OpenNVRTCFrom([]string{"libnvrtc-sonar-test-does-not-exist.so.99"})
	if !errors.Is(err, ErrNoNVRTC) {
		t.Fatalf("err = %v, want ErrNoNVRTC", err)
	}
	if want := "cuda: no NVRTC (libnvrtc-sonar-test-does-not-exist.so.99 not found)"; err.Error() != want {
		t.Errorf("message %q, want %q", err, want)
	}
}

func TestNVRTCCandidatesEnvFirst(t *testing.T) {
	t.Setenv(NVRTCEnv, "/opt/x/libnvrtc.so.13")
	c := NVRTCCandidates()
	if len(c) == 0 || c[0] != "/opt/x/libnvrtc.so.13" {
		t.Fatalf("candidates %v: $%s must come first", c, NVRTCEnv)
	}
	if c[len(c)-1] != "libnvrtc.so" {
		t.Errorf("the plain soname must come last: %v", c)
	}
}

// TestCompileKernels compiles the embedded kernels with a real NVRTC (no GPU
// needed) and checks the PTX: every entry point is there, the float
// arithmetic is the IEEE kind the source asks for, and the 4 KB batch
// parameter is not copied to local memory.
func TestCompileKernels(t *testing.T) {
	nv := testNVRTC(t)
	maj, mnr := nv.Version()
	t.Logf("NVRTC %d.%d from %s, archs %v", maj, mnr, nv.Path(), nv.SupportedArchs())
	for _, arch := range []int{90, 80, 75} {
		if a, err := nv.PickArch(arch/10, arch%10); err != nil || a != arch {
			t.Logf("sm_%d not supported by this NVRTC (%d, %v)", arch, a, err)
			continue
		}
		ptx, err := CompileKernels(nv, arch)
		if err != nil {
			t.Fatalf("compute_%d: %v", arch, err)
		}
		s := string(ptx)
		for _, k := range kernelNames {
			if !strings.Contains(s, ".entry "+k+"(") {
				t.Errorf("compute_%d: no entry %s", arch, k)
			}
		}
		for _, bad := range []string{"div.approx", "sqrt.approx", ".ftz.", "rcp.approx", "mad.f32"} {
			if strings.Contains(s, bad) {
				t.Errorf("compute_%d: PTX has %q: not IEEE float arithmetic", arch, bad)
			}
		}
		if arch >= 80 && !strings.Contains(s, "cvt.rn.bf16.f32") {
			t.Errorf("compute_%d: bfloat16 rounding should be cvt.rn.bf16.f32", arch)
		}
		// No per-thread copy of the batch (a local depot of >= 1 KB).
		for _, m := range regexp.MustCompile(`__local_depot\d*\[(\d+)\]`).FindAllStringSubmatch(s, -1) {
			if len(m[1]) >= 4 {
				t.Errorf("compute_%d: local memory %s bytes: the batch parameter is copied per thread", arch, m[1])
			}
		}
		if !strings.Contains(s, "fma.rn.f32") || !strings.Contains(s, "div.rn.f32") || !strings.Contains(s, "sqrt.rn.f32") {
			t.Errorf("compute_%d: expected fma.rn, div.rn and sqrt.rn in the PTX", arch)
		}
	}
}

func TestCompileErrorHasLog(t *testing.T) {
	nv := testNVRTC(t)
	_, err := nv.Compile("extern \"C\" __global__ void k() { this is not C; }", "bad.cu", CompileOptions(75))
	var ne *NVRTCError
	if !errors.As(err, &ne) || ne.Code != 6 || !strings.Contains(ne.Log, "bad.cu") {
		t.Fatalf("err = %v, want NVRTC_ERROR_COMPILATION with a log naming bad.cu", err)
	}
}
