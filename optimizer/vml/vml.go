// Package vml loads, at run time, the vector square root that PyTorch uses
// for float32 tensors on x86 CPUs: Intel MKL's vmsSqrt in high-accuracy mode,
// linked into the client's libtorch_cpu.so. With MKL's AVX-512 code path that
// routine is not correctly rounded (about 0.6% of results are one ulp below
// the IEEE square root), and its algorithm is not documented, so the only way
// to be bit-for-bit equal to torch is to call the very same function. Where
// no library is given, callers use the IEEE square root, which is what torch
// computes without MKL (and for bfloat16).
package vml

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef void (*vms_fn)(int32_t n, const float *a, float *r, int64_t mode);

static void *sonar_dlopen(const char *path, char **err) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) *err = dlerror();
	return h;
}
static void *sonar_dlsym(void *h, const char *name) { return dlsym(h, name); }
static void sonar_vms(void *f, int32_t n, const float *a, float *r, int64_t mode) {
	((vms_fn)f)(n, a, r, mode);
}
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// Mode is what ATen passes to MKL: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
const Mode = 0x2 | 0x140000 | 0x100

// Sqrt computes dst[i] = sqrt(src[i]) with MKL's vmsSqrt.
type Sqrt struct {
	fn   unsafe.Pointer
	Path string
}

var (
	mu     sync.Mutex
	loaded = map[string]*Sqrt{}
)

// Load opens lib (a libtorch_cpu.so, or any library exporting vmsSqrt) once
// per path and returns its square root.
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
	// MKL must not start threads of its own inside the engine's goroutines.
	if os.Getenv("MKL_NUM_THREADS") == "" {
		_ = os.Setenv("MKL_NUM_THREADS", "1")
	}
	cpath := C.CString(lib)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	h := C.sonar_dlopen(cpath, &cerr)
	if h == nil {
		return nil, fmt.Errorf("vml: dlopen %s: %s", lib, C.GoString(cerr))
	}
	name := C.CString("vmsSqrt")
	defer C.free(unsafe.Pointer(name))
	fn := C.sonar_dlsym(h, name)
	if fn == nil {
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
		n := len(src)
		if n > 1<<30 {
			n = 1 << 30
		}
		C.sonar_vms(s.fn, C.int32_t(n), (*C.float)(unsafe.Pointer(&src[0])), (*C.float)(unsafe.Pointer(&dst[0])), C.int64_t(Mode))
		src, dst = src[n:], dst[n:]
	}
}
