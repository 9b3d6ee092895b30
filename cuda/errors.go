package cuda

import (
	"errors"
	"fmt"
)

// Result is a CUresult, the status code every driver API call returns.
type Result int32

// Driver API status codes used by this package (cuda.h's CUresult values).
const (
	Success                 Result = 0
	ErrorInvalidValue       Result = 1
	ErrorOutOfMemory        Result = 2
	ErrorNotInitialized     Result = 3
	ErrorDeinitialized      Result = 4
	ErrorStubLibrary        Result = 34
	ErrorNoDevice           Result = 100
	ErrorInvalidDevice      Result = 101
	ErrorInvalidImage       Result = 200
	ErrorInvalidContext     Result = 201
	ErrorAlreadyMapped      Result = 208
	ErrorInvalidPTX         Result = 218
	ErrorUnsupportedPTX     Result = 222
	ErrorInvalidHandle      Result = 400
	ErrorNotFound           Result = 500
	ErrorNotReady           Result = 600
	ErrorIllegalAddress     Result = 700
	ErrorLaunchOutOfRes     Result = 701
	ErrorLaunchFailed       Result = 719
	ErrorNotPermitted       Result = 800
	ErrorNotSupported       Result = 801
	ErrorSystemDriverMismat Result = 803
	ErrorUnknown            Result = 999
)

// resultNames names the CUresult values, for messages when the driver's own
// cuGetErrorName/cuGetErrorString are not available (or do not know a code).
var resultNames = map[Result]string{
	0:   "CUDA_SUCCESS",
	1:   "CUDA_ERROR_INVALID_VALUE",
	2:   "CUDA_ERROR_OUT_OF_MEMORY",
	3:   "CUDA_ERROR_NOT_INITIALIZED",
	4:   "CUDA_ERROR_DEINITIALIZED",
	5:   "CUDA_ERROR_PROFILER_DISABLED",
	34:  "CUDA_ERROR_STUB_LIBRARY",
	46:  "CUDA_ERROR_DEVICE_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE",
	101: "CUDA_ERROR_INVALID_DEVICE",
	102: "CUDA_ERROR_DEVICE_NOT_LICENSED",
	200: "CUDA_ERROR_INVALID_IMAGE",
	201: "CUDA_ERROR_INVALID_CONTEXT",
	202: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	205: "CUDA_ERROR_MAP_FAILED",
	206: "CUDA_ERROR_UNMAP_FAILED",
	208: "CUDA_ERROR_ALREADY_MAPPED",
	209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
	210: "CUDA_ERROR_ALREADY_ACQUIRED",
	211: "CUDA_ERROR_NOT_MAPPED",
	214: "CUDA_ERROR_ECC_UNCORRECTABLE",
	216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	218: "CUDA_ERROR_INVALID_PTX",
	220: "CUDA_ERROR_NVLINK_UNCORRECTABLE",
	221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	223: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
	300: "CUDA_ERROR_INVALID_SOURCE",
	301: "CUDA_ERROR_FILE_NOT_FOUND",
	302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
	303: "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
	304: "CUDA_ERROR_OPERATING_SYSTEM",
	400: "CUDA_ERROR_INVALID_HANDLE",
	401: "CUDA_ERROR_ILLEGAL_STATE",
	500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	702: "CUDA_ERROR_LAUNCH_TIMEOUT",
	704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	708: "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	710: "CUDA_ERROR_ASSERT",
	714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
	715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	717: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	718: "CUDA_ERROR_INVALID_PC",
	719: "CUDA_ERROR_LAUNCH_FAILED",
	720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
	800: "CUDA_ERROR_NOT_PERMITTED",
	801: "CUDA_ERROR_NOT_SUPPORTED",
	802: "CUDA_ERROR_SYSTEM_NOT_READY",
	803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
	999: "CUDA_ERROR_UNKNOWN",
}

// Name is the code's CUDA_ERROR_* name, or "CUresult(n)" for codes not listed.
func (r Result) Name() string {
	if s, ok := resultNames[r]; ok {
		return s
	}
	return fmt.Sprintf("CUresult(%d)", int32(r))
}

// Sticky reports whether the code leaves the CUDA context unusable: after such
// an error (a kernel fault) every later call in the process fails too, and the
// only recovery is a new process.
func (r Result) Sticky() bool {
	switch r {
	case 700, 710, 714, 715, 716, 717, 718, 719, 720:
		return true
	}
	return false
}

// Error is a failed driver API call.
type Error struct {
	Op   string // the API function, e.g. "cuMemAlloc_v2"
	Code Result
	Msg  string // the driver's description (cuGetErrorString), may be empty
}

func (e *Error) Error() string {
	if e.Msg != "" {
		return fmt.Sprintf("cuda: %s: %s (%s)", e.Op, e.Msg, e.Code.Name())
	}
	return fmt.Sprintf("cuda: %s: %s", e.Op, e.Code.Name())
}

// Is makes errors.Is(err, &Error{Code: c}) match any error with code c.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Op == "" && t.Code == e.Code
}

// CodeOf returns the CUresult of err, or Success when err is not a driver error.
func CodeOf(err error) Result {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Success
}

// NVRTCResult is an nvrtcResult status code.
type NVRTCResult int32

var nvrtcNames = map[NVRTCResult]string{
	0:  "NVRTC_SUCCESS",
	1:  "NVRTC_ERROR_OUT_OF_MEMORY",
	2:  "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	3:  "NVRTC_ERROR_INVALID_INPUT",
	4:  "NVRTC_ERROR_INVALID_PROGRAM",
	5:  "NVRTC_ERROR_INVALID_OPTION",
	6:  "NVRTC_ERROR_COMPILATION",
	7:  "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
	8:  "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
	9:  "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
	10: "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
	11: "NVRTC_ERROR_INTERNAL_ERROR",
	12: "NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
}

// Name is the code's NVRTC_* name.
func (r NVRTCResult) Name() string {
	if s, ok := nvrtcNames[r]; ok {
		return s
	}
	return fmt.Sprintf("nvrtcResult(%d)", int32(r))
}

// NVRTCError is a failed NVRTC call; Log holds the compiler's output for
// compilation errors.
type NVRTCError struct {
	Op   string
	Code NVRTCResult
	Log  string
}

func (e *NVRTCError) Error() string {
	s := fmt.Sprintf("nvrtc: %s: %s", e.Op, e.Code.Name())
	if e.Log != "" {
		s += "\n" + e.Log
	}
	return s
}

// ErrNoDriver is matched (errors.Is) by every error that means the CUDA
// driver library could not be loaded.
var ErrNoDriver = errors.New("cuda: no CUDA driver")

// ErrNoNVRTC is matched by every error that means no NVRTC library could be loaded.
var ErrNoNVRTC = errors.New("cuda: no NVRTC")

// libError says a shared library could not be loaded.
type libError struct {
	sentinel error  // ErrNoDriver or ErrNoNVRTC
	what     string // "CUDA driver", "NVRTC"
	name     string // the library name tried (the first, for several)
	notFound bool   // dlopen found no such file
	detail   string // dlopen's message(s)
}

func (e *libError) Error() string {
	if e.notFound {
		return fmt.Sprintf("cuda: no %s (%s not found)", e.what, e.name)
	}
	return fmt.Sprintf("cuda: cannot load %s %s: %s", e.what, e.name, e.detail)
}

func (e *libError) Unwrap() error { return e.sentinel }

// Detail is the dynamic loader's message.
func (e *libError) Detail() string { return e.detail }
