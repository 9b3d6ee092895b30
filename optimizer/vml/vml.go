// Package vml loads, at run time, the vector square root that PyTorch uses
// for float32 tensors on x86 CPUs: Intel MKL's vmsSqrt in high-accuracy mode,
// linked into the client's libtorch_cpu.so. With MKL's AVX-512 code path that
// routine is not correctly rounded (about 0.6% of results are one ulp below
// the IEEE square root; on an AVX2 AMD EPYC, 17.1% of all non-negative
// float32 inputs differ, checked exhaustively in 2026-12), and its algorithm
// is not documented, so bit-for-bit equality with torch starts from the very
// same function: callers call it, or compute the arithmetic of the MKL
// kernel that runs on this CPU (optimizer.MKLSqrt) once a comparison with it
// finds the two equal. Where no library is given, callers use the IEEE
// square root, which is what torch computes without MKL (and for bfloat16).
package vml

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Mode is what ATen passes to MKL: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
const Mode = 0x2 | 0x140000 | 0x100

// Sqrt computes dst[i] = sqrt(src[i]) with MKL's vmsSqrt.
type Sqrt struct {
	fn   uintptr // vmsSqrt(int n, const float *a, float *r, int64 mode)
	Path string
}

var (
	mu     sync.Mutex
	loaded = map[string]*Sqrt{}
)

// Load opens lib (a libtorch_cpu.so, or any library exporting vmsSqrt) once
// per path, at run time through purego as package cuda loads the CUDA
// libraries, and returns its square root. Set MKL_NUM_THREADS=1 in the
// process before the first Load (sonard does) so that MKL starts no threads
// of its own.
func Load(lib string) (*Sqrt, error) {
	mu.Lock()
	defer mu.Unlock()
	if s := loaded[lib]; s != nil {
		return s, nil
	}
	st, err := os.Stat(lib)
	if err != nil {
		return nil, fmt.Errorf("vml: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("vml: %s is not a regular file", lib)
	}
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("vml: dlopen %s: %w", lib, err)
	}
	fn, err := purego.Dlsym(h, "vmsSqrt")
	if err != nil {
		return nil, fmt.Errorf("vml: %s does not export vmsSqrt", lib)
	}
	s := &Sqrt{fn: fn, Path: lib}
	loaded[lib] = s
	return s, nil
}

// Apply computes dst[i] = sqrt(src[i]) for i < len(src); len(dst) >= len(src).
func (s *Sqrt) Apply(dst, src []float32) {
	if len(src) == 0 {
		return
	}
	_ = dst[len(src)-1]
	for len(src) > 0 {
		n := min(len(src), 1<<30)
		// SyscallN, not RegisterLibFunc: no reflection on a call made once per
		// 512-element block.
		purego.SyscallN(s.fn, uintptr(n), uintptr(unsafe.Pointer(&src[0])), uintptr(unsafe.Pointer(&dst[0])), Mode)
		src, dst = src[n:], dst[n:]
	}
}
