package optimizer

import (
	"fmt"
	"syscall"
	"unsafe"
)

// MapThreshold is the buffer size from which state buffers are anonymous
// memory mappings instead of Go heap: a mapping the kernel refuses (ulimit
// -v, overcommit limits) is an error the caller can answer, where a Go heap
// allocation that fails is a fatal "runtime: out of memory".
const MapThreshold = 1 << 20

// buffer is one state buffer: the staggered bytes and, for a mapping, the
// whole mapped region (to unmap).
type buffer struct {
	b      []byte
	region []byte // nil for Go heap memory
}

// allocStaggered returns n zeroed bytes starting at off mod 4096 (see
// staggered), mapped from the kernel when n >= MapThreshold.
func allocStaggered(n, off int) (buffer, error) {
	if n < MapThreshold {
		return buffer{b: staggered(n, off)}, nil
	}
	region, err := syscall.Mmap(-1, 0, n+4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return buffer{}, fmt.Errorf("allocate %d bytes: %w", n, err)
	}
	start := (off - int(uintptr(unsafe.Pointer(&region[0]))%4096) + 4096) % 4096
	return buffer{b: region[start : start+n : start+n], region: region}, nil
}

// free gives a mapped buffer back to the kernel (heap memory is the
// collector's); the bytes must not be used after.
func (b *buffer) free() {
	if b.region != nil {
		_ = syscall.Munmap(b.region)
	}
	*b = buffer{}
}
