package cuda

import (
	"errors"
	"path/filepath"
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

func TestCompileErrorHasLog(t *testing.T) {
	nv := testNVRTC(t)
	_, err := nv.Compile("extern \"C\" __global__ void k() { this is not C; }", "bad.cu", []string{"--gpu-architecture=compute_75"})
	var ne *NVRTCError
	if !errors.As(err, &ne) || ne.Code != 6 || !strings.Contains(ne.Log, "bad.cu") {
		t.Fatalf("err = %v, want NVRTC_ERROR_COMPILATION with a log naming bad.cu", err)
	}
}
