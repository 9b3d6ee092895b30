// Package cudatest provides a stand-in CUDA driver for tests on machines
// without a GPU: a libcuda.so.1 built from C at test time with the host
// compiler, exporting every driver function package cuda binds. Device
// memory is host memory (malloc), so copies and memsets really happen;
// kernels do not run, but each launch records its grid, stream and first
// parameter, and every stream operation is appended to a log, so callers
// can check launch descriptors, event order, allocations and IPC opens.
// It imports nothing of the project (package cuda's own tests use it).
package cudatest

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ebitengine/purego"
)

// IPC memory handles the stand-in exports (cuIpcGetMemHandle) carry this
// magic in their first bytes and the allocation's address after it, so that
// opening them in the same process gives back the same memory.
const ipcMagic = "SONARFAK"

const driverC = `
#include <stdlib.h>
#include <string.h>
typedef unsigned long long u64;
typedef struct { char r[64]; } H;
static int fail_code; static char fail_op[64];
static int chk(const char* op) { if (fail_code && !strcmp(op, fail_op)) { int c = fail_code; fail_code = 0; return c; } return 0; }
void fake_fail(const char* op, int code) { strncpy(fail_op, op, 63); fail_code = code; }
static void* cur_ctx; static int retained, released;
static H last_mem_handle, last_event_handle; static unsigned last_ipc_flags; static int ipc_closed, ipc_opened;
static unsigned launch_dims[7]; static void* launch_stream; static unsigned char launch_param[8192]; static int launches;
static char loaded_image[64];
static char oplog[65536]; static int oplen;
static void logop(const char* s) { int n = strlen(s); if (oplen + n + 1 < (int)sizeof oplog) { memcpy(oplog + oplen, s, n); oplen += n; oplog[oplen++] = ' '; oplog[oplen] = 0; } }
#define MAXA 4096
static u64 abase[MAXA]; static size_t asize[MAXA]; static int live;
static void track(u64 p, size_t n) { for (int i = 0; i < MAXA; i++) if (!abase[i]) { abase[i] = p; asize[i] = n; live++; return; } }
static int untrack(u64 p) { for (int i = 0; i < MAXA; i++) if (abase[i] == p) { abase[i] = 0; live--; return 1; } return 0; }
static int lookup(u64 p, u64* b, size_t* n) { for (int i = 0; i < MAXA; i++) if (abase[i] && p >= abase[i] && p < abase[i] + asize[i]) { *b = abase[i]; *n = asize[i]; return 1; } return 0; }
int fake_state(int what) { switch (what) { case 0: return retained; case 1: return released; case 2: return (int)last_ipc_flags; case 3: return ipc_closed; case 4: return live; case 5: return ipc_opened; case 6: return launches; } return -1; }
void fake_launch(unsigned* dims, void** stream, unsigned char* param, int n) { memcpy(dims, launch_dims, sizeof launch_dims); *stream = launch_stream; memcpy(param, launch_param, n); }
void fake_handles(H* mem, H* ev) { *mem = last_mem_handle; *ev = last_event_handle; }
const char* fake_image(void) { return loaded_image; }
const char* fake_log(void) { return oplog; }
static char fnames[64][64]; static int nfn;
static char klog[65536]; static int klen;
const char* fake_kernels(void) { return klog; }
void fake_clear_log(void) { oplen = 0; oplog[0] = 0; klen = 0; klog[0] = 0; }
int cuGetErrorString(int c, const char** s) { if (c == 2) { *s = "out of memory"; return 0; } if (c == 999) { *s = "unknown error"; return 0; } return 1; }
int cuGetErrorName(int c, const char** s) { *s = "X"; return 0; }
int cuInit(unsigned f) { return chk("cuInit"); }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
int cuDeviceGetCount(int* n) { *n = 1; return chk("cuDeviceGetCount"); }
int cuDeviceGet(int* d, int o) { if (o != 0) return 101; *d = 0; return 0; }
int cuDeviceGetName(char* n, int len, int d) { strncpy(n, "Fake H200", len); return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) { *v = a == 75 ? 9 : a == 76 ? 0 : a == 16 ? 132 : -1; return 0; }
int cuDeviceTotalMem_v2(size_t* b, int d) { *b = (size_t)141 << 30; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0xC0; retained++; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { released++; return 0; }
int cuCtxSetCurrent(void* c) { cur_ctx = c; return c == (void*)0xC0 ? 0 : 201; }
int cuMemAlloc_v2(u64* p, size_t n) { int e = chk("cuMemAlloc_v2"); if (e) return e; *p = (u64)calloc(1, n); track(*p, n); return 0; }
int cuMemFree_v2(u64 p) { if (!untrack(p)) return 1; free((void*)p); return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t) { *f = 100; *t = 200; return 0; }
int cuMemGetAddressRange_v2(u64* base, size_t* size, u64 p) { if (!lookup(p, base, size)) { *base = p; *size = 4096; } return chk("cuMemGetAddressRange_v2"); }
int cuMemcpyHtoD_v2(u64 dst, const void* src, size_t n) { memcpy((void*)dst, src, n); return 0; }
int cuMemcpyDtoH_v2(void* dst, u64 src, size_t n) { memcpy(dst, (void*)src, n); return 0; }
int cuMemcpyDtoDAsync_v2(u64 dst, u64 src, size_t n, void* s) { int e = chk("cuMemcpyDtoDAsync_v2"); if (e) return e; logop("copy"); memmove((void*)dst, (void*)src, n); return 0; }
int cuMemsetD8Async(u64 dst, unsigned char v, size_t n, void* s) { logop("zero"); memset((void*)dst, v, n); return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = (void*)(0x5000 + (u64)f); return 0; }
int cuStreamDestroy_v2(void* s) { return 0; }
int cuStreamSynchronize(void* s) { return chk("cuStreamSynchronize"); }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { logop("wait"); return e == (void*)0xE1 ? 0 : 400; }
int cuEventCreate(void** e, unsigned f) { *e = (void*)(0xE000 + (u64)f); return 0; }
int cuEventRecord(void* e, void* s) { logop("record"); return 0; }
int cuEventSynchronize(void* e) { logop("sync"); return chk("cuEventSynchronize"); }
static int queries; int cuEventQuery(void* e) { return queries++ == 0 ? 600 : 0; }
int cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 1.5f; return 0; }
int cuEventDestroy_v2(void* e) { return 0; }
int cuIpcGetEventHandle(H* h, void* e) { memset(h, 0x42, sizeof *h); return 0; }
int cuIpcOpenEventHandle(void** e, H h) { int x = chk("cuIpcOpenEventHandle"); if (x) return x; last_event_handle = h; *e = (void*)0xE1; return 0; }
int cuIpcGetMemHandle(H* h, u64 p) { memset(h, 0x24, sizeof *h); memcpy(h->r, "` + ipcMagic + `", 8); memcpy(h->r + 8, &p, 8); return 0; }
int cuIpcOpenMemHandle_v2(u64* p, H h, unsigned flags) {
  int e = chk("cuIpcOpenMemHandle_v2"); if (e) return e; last_mem_handle = h; last_ipc_flags = flags; ipc_opened++;
  if (!memcmp(h.r, "` + ipcMagic + `", 8)) { memcpy(p, h.r + 8, 8); return 0; }
  *p = 0x7f0000000000ULL + (unsigned char)h.r[0] * 0x100000ULL; return 0; }
int cuIpcCloseMemHandle(u64 p) { ipc_closed++; return 0; }
int cuModuleLoadData(void** m, const void* img) { strncpy(loaded_image, (const char*)img, 63); *m = (void*)0x30; return chk("cuModuleLoadData"); }
int cuModuleUnload(void* m) { return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) {
  if (strncmp(name, "sonar_", 6) || nfn == 64) return 500;
  for (int i = 0; i < nfn; i++) if (!strcmp(fnames[i], name)) { *f = (void*)(0xF000UL + i); return 0; }
  strncpy(fnames[nfn], name, 63); *f = (void*)(0xF000UL + nfn++); return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                   void* stream, void** params, void** extra) {
  unsigned d[7] = {gx, gy, gz, bx, by, bz, shmem}; memcpy(launch_dims, d, sizeof d); launch_stream = stream;
  if (extra) return 1;
  int e = chk("cuLaunchKernel"); if (e) return e;
  logop("launch"); launches++; memcpy(launch_param, params[0], 3888);
  unsigned long i = (unsigned long)f - 0xF000UL; const char* n = i < (unsigned long)nfn ? fnames[i] : "?"; int l = strlen(n);
  if (klen + l + 1 < (int)sizeof klog) { memcpy(klog + klen, n, l); klen += l; klog[klen++] = ' '; klog[klen] = 0; }
  return 0;
}
`

// Fake is the built stand-in driver and its controls.
type Fake struct {
	// Path is the library to open (cuda.OpenLibrary(Path)).
	Path string
	// State reports counters: 0 contexts retained, 1 released, 2 the last
	// IPC open flags, 3 IPC handles closed, 4 live allocations, 5 IPC
	// handles opened, 6 kernel launches.
	State func(what int32) int32
	// Fail makes the next call of op return code.
	Fail func(op string, code int32)
	// Launch copies the last launch's dims (grid xyz, block xyz, shared
	// memory), stream and first n bytes of its first parameter.
	Launch func(dims *[7]uint32, stream *uintptr, param *byte, n int32)
	// Handles copies the last opened memory and event handles.
	Handles func(mem, ev *[64]byte)
	// Image is the start of the last module image loaded.
	Image func() string
	// Log is the stream operations so far ("zero", "copy", "wait",
	// "launch", "record", "sync"), space-separated; ClearLog empties it.
	Log      func() string
	ClearLog func()
	// Kernels names the kernels launched since ClearLog, in order,
	// space-separated.
	Kernels func() string
}

// Counters of Fake.State.
const (
	Retained int32 = iota
	Released
	IPCFlags
	IPCClosed
	LiveAllocs
	IPCOpened
	Launches
)

var (
	once  sync.Once
	built *Fake
	bErr  error
)

// Driver builds the stand-in once per test binary and returns it; the test
// is skipped where there is no C compiler. The library is loaded once per
// process, so its counters are shared by every test of a binary.
func Driver(t testing.TB) *Fake {
	t.Helper()
	once.Do(func() { built, bErr = build() })
	if bErr != nil {
		t.Skipf("cannot build the stand-in CUDA driver: %v", bErr)
	}
	return built
}

func build() (*Fake, error) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "sonar-fakecuda")
	if err != nil {
		return nil, err
	}
	src := filepath.Join(dir, "fake.c")
	if err := os.WriteFile(src, []byte(driverC), 0o644); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "libcuda.so.1")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-O1", "-o", path, src).CombinedOutput(); err != nil {
		return nil, errors.New(string(out))
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	// The library stays mapped, and a later dlopen of the same path (cuda.OpenLibrary) finds it
	// among the loaded ones by name, so the directory goes now: a test binary has no exit hook,
	// and each run left one in the temporary directory.
	os.RemoveAll(dir)
	if err != nil {
		return nil, err
	}
	f := &Fake{Path: path}
	purego.RegisterLibFunc(&f.State, h, "fake_state")
	purego.RegisterLibFunc(&f.Fail, h, "fake_fail")
	purego.RegisterLibFunc(&f.Launch, h, "fake_launch")
	purego.RegisterLibFunc(&f.Handles, h, "fake_handles")
	purego.RegisterLibFunc(&f.Image, h, "fake_image")
	purego.RegisterLibFunc(&f.Log, h, "fake_log")
	purego.RegisterLibFunc(&f.ClearLog, h, "fake_clear_log")
	purego.RegisterLibFunc(&f.Kernels, h, "fake_kernels")
	return f, nil
}

// NVRTCPaths lists the NVRTC libraries of the repository's virtual
// environment (torch's CUDA wheels bring nvidia-cuda-nvrtc), searched from
// dir upwards, so tests can compile the real kernels without a CUDA toolkit.
func NVRTCPaths(dir string) []string {
	var out []string
	for d, prev := dir, ""; d != prev; d, prev = filepath.Dir(d), d {
		libs, _ := filepath.Glob(filepath.Join(d, ".venv", "lib", "python3*", "site-packages", "nvidia", "*", "lib", "libnvrtc.so*"))
		libs2, _ := filepath.Glob(filepath.Join(d, ".venv", "lib", "python3*", "site-packages", "nvidia", "cu*", "lib", "libnvrtc.so*"))
		for _, l := range append(libs, libs2...) {
			if !strings.Contains(filepath.Base(l), "builtins") {
				abs, _ := filepath.Abs(l)
				out = append(out, abs)
			}
		}
		if len(out) > 0 {
			break
		}
	}
	return out
}
