package cuda

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unsafe"
)

// NVRTCEnv names a file to load NVRTC from, tried before the usual places.
const NVRTCEnv = "SONAR_NVRTC"

// NVRTC is the loaded runtime compiler.
type NVRTC struct {
	path         string
	major, minor int
	archs        []int // supported SM versions (e.g. 90), when the library can say

	nvrtcVersion             func(major, minor *int32) int32
	nvrtcGetErrorString      func(code int32) string
	nvrtcCreateProgram       func(prog *uintptr, src, name string, numHeaders int32, headers, includeNames unsafe.Pointer) int32
	nvrtcCompileProgram      func(prog uintptr, numOptions int32, options unsafe.Pointer) int32
	nvrtcGetPTXSize          func(prog uintptr, size *uint64) int32
	nvrtcGetPTX              func(prog uintptr, ptx *byte) int32
	nvrtcGetProgramLogSize   func(prog uintptr, size *uint64) int32
	nvrtcGetProgramLog       func(prog uintptr, log *byte) int32
	nvrtcDestroyProgram      func(prog *uintptr) int32
	nvrtcGetNumSupportedArch func(n *int32) int32
	nvrtcGetSupportedArchs   func(archs *int32) int32
}

// NVRTCCandidates lists where OpenNVRTC looks, in order: $SONAR_NVRTC; the
// lib64 directories of $CUDA_HOME, $CUDA_PATH and /usr/local/cuda; the
// library directories of the nvidia-cuda-nvrtc Python wheels of the
// interpreter prefixes in $SONAR_PYTHON_PREFIXES, $VIRTUAL_ENV and
// $CONDA_PREFIX; then the plain sonames, newest first, for the dynamic
// loader's own search (LD_LIBRARY_PATH, ldconfig).
func NVRTCCandidates() []string {
	var out []string
	if p := os.Getenv(NVRTCEnv); p != "" {
		out = append(out, p)
	}
	sonames := []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"}
	var dirs []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if v := os.Getenv(env); v != "" {
			dirs = append(dirs, filepath.Join(v, "lib64"), filepath.Join(v, "lib"))
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64")
	var prefixes []string
	for _, env := range []string{"SONAR_PYTHON_PREFIXES", "VIRTUAL_ENV", "CONDA_PREFIX"} {
		prefixes = append(prefixes, filepath.SplitList(os.Getenv(env))...)
	}
	for _, pre := range prefixes {
		if pre == "" {
			continue
		}
		for _, pat := range []string{"lib/python3*/site-packages/nvidia/cu13/lib", "lib/python3*/site-packages/nvidia/cuda_nvrtc/lib"} {
			m, _ := filepath.Glob(filepath.Join(pre, pat))
			sort.Sort(sort.Reverse(sort.StringSlice(m)))
			dirs = append(dirs, m...)
		}
	}
	for _, d := range dirs {
		for _, s := range sonames {
			p := filepath.Join(d, s)
			if _, err := os.Stat(p); err == nil {
				out = append(out, p)
			}
		}
	}
	return append(out, sonames...)
}

var (
	nvrtcOnce sync.Once
	nvrtcLib  *NVRTC
	nvrtcErr  error
)

// OpenNVRTC loads NVRTC once per process from the first of NVRTCCandidates
// that loads.
func OpenNVRTC() (*NVRTC, error) {
	nvrtcOnce.Do(func() { nvrtcLib, nvrtcErr = OpenNVRTCFrom(NVRTCCandidates()) })
	return nvrtcLib, nvrtcErr
}

// OpenNVRTCFrom loads NVRTC from the first of names that loads.
func OpenNVRTCFrom(names []string) (*NVRTC, error) {
	h, path, err := openLibrary(ErrNoNVRTC, "NVRTC", names)
	if err != nil {
		return nil, err
	}
	n := &NVRTC{path: path}
	b := &binder{lib: h, libName: path}
	b.bind(&n.nvrtcVersion, "nvrtcVersion")
	b.bind(&n.nvrtcGetErrorString, "nvrtcGetErrorString")
	b.bind(&n.nvrtcCreateProgram, "nvrtcCreateProgram")
	b.bind(&n.nvrtcCompileProgram, "nvrtcCompileProgram")
	b.bind(&n.nvrtcGetPTXSize, "nvrtcGetPTXSize")
	b.bind(&n.nvrtcGetPTX, "nvrtcGetPTX")
	b.bind(&n.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize")
	b.bind(&n.nvrtcGetProgramLog, "nvrtcGetProgramLog")
	b.bind(&n.nvrtcDestroyProgram, "nvrtcDestroyProgram")
	if b.err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoNVRTC, b.err)
	}
	var maj, mnr int32
	if err := n.check("nvrtcVersion", n.nvrtcVersion(&maj, &mnr), 0); err != nil {
		return nil, err
	}
	n.major, n.minor = int(maj), int(mnr)
	if b.optional(&n.nvrtcGetNumSupportedArch, "nvrtcGetNumSupportedArchs") &&
		b.optional(&n.nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs") {
		var cnt int32
		if n.nvrtcGetNumSupportedArch(&cnt) == 0 && cnt > 0 && cnt < 1024 {
			a := make([]int32, cnt)
			if n.nvrtcGetSupportedArchs(&a[0]) == 0 {
				for _, v := range a {
					n.archs = append(n.archs, int(v))
				}
			}
		}
	}
	return n, nil
}

// Path is the library NVRTC was loaded from.
func (n *NVRTC) Path() string { return n.path }

// Version is NVRTC's CUDA version.
func (n *NVRTC) Version() (major, minor int) { return n.major, n.minor }

// SupportedArchs lists the SM versions NVRTC compiles for (nil if unknown).
func (n *NVRTC) SupportedArchs() []int { return append([]int(nil), n.archs...) }

func (n *NVRTC) check(op string, code int32, prog uintptr) error {
	if code == 0 {
		return nil
	}
	e := &NVRTCError{Op: op, Code: NVRTCResult(code)}
	if prog != 0 {
		e.Log = n.log(prog)
	}
	return e
}

func (n *NVRTC) log(prog uintptr) string {
	var size uint64
	if n.nvrtcGetProgramLogSize(prog, &size) != 0 || size <= 1 || size > 1<<24 {
		return ""
	}
	buf := make([]byte, size)
	if n.nvrtcGetProgramLog(prog, &buf[0]) != 0 {
		return ""
	}
	return strings.TrimRight(string(buf), "\x00\n")
}

// PickArch returns the virtual architecture to compile for a device of
// compute capability major.minor: the device's own when NVRTC supports it,
// otherwise the newest NVRTC supports below it (the driver JIT-compiles that
// PTX for the device).
func (n *NVRTC) PickArch(major, minor int) (int, error) {
	want := major*10 + minor
	if len(n.archs) == 0 {
		return want, nil
	}
	best := 0
	for _, a := range n.archs {
		if a == want {
			return want, nil
		}
		if a < want && a > best {
			best = a
		}
	}
	if best == 0 {
		return 0, fmt.Errorf("nvrtc %d.%d supports none of the architectures up to sm_%d (it supports %v)", n.major, n.minor, want, n.archs)
	}
	return best, nil
}

// Compile compiles CUDA C source to PTX with the given options; on a
// compilation error the returned *NVRTCError carries the compiler log.
func (n *NVRTC) Compile(src, name string, options []string) ([]byte, error) {
	var prog uintptr
	if err := n.check("nvrtcCreateProgram", n.nvrtcCreateProgram(&prog, src, name, 0, nil, nil), 0); err != nil {
		return nil, err
	}
	defer n.nvrtcDestroyProgram(&prog)
	opts := newCStrings(options)
	code := n.nvrtcCompileProgram(prog, int32(len(options)), opts.array())
	runtime.KeepAlive(opts)
	if err := n.check("nvrtcCompileProgram", code, prog); err != nil {
		return nil, fmt.Errorf("compiling %s: %w", name, err)
	}
	var size uint64
	if err := n.check("nvrtcGetPTXSize", n.nvrtcGetPTXSize(prog, &size), prog); err != nil {
		return nil, err
	}
	if size == 0 || size > 1<<28 {
		return nil, fmt.Errorf("nvrtc: implausible PTX size %d", size)
	}
	ptx := make([]byte, size)
	if err := n.check("nvrtcGetPTX", n.nvrtcGetPTX(prog, &ptx[0]), prog); err != nil {
		return nil, err
	}
	return ptx, nil // NUL-terminated, as cuModuleLoadData wants
}
