package cuda

import (
	"encoding/binary"
	"math"
	"unsafe"
)

// Args packs the arguments of a kernel launch. cuLaunchKernel takes them as
// an array of pointers, one per kernel parameter, each pointing at the
// parameter's value laid out as the kernel declares it. Every value here
// lives in its own 8-byte aligned Go allocation (the Go heap does not move
// objects), and the pointer array holds real pointers, so the values stay
// alive and in place while Launch runs.
type Args struct {
	vals [][]uint64
	size []int // bytes of each value
}

// NewArgs returns an empty argument list.
func NewArgs() *Args { return &Args{} }

func (a *Args) add(b []byte) *Args {
	buf := make([]uint64, (len(b)+7)/8)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), len(buf)*8), b)
	a.vals = append(a.vals, buf)
	a.size = append(a.size, len(b))
	return a
}

// Ptr appends a device pointer (8 bytes).
func (a *Args) Ptr(p DevicePtr) *Args { return a.U64(uint64(p)) }

// U64 appends a 64-bit integer.
func (a *Args) U64(v uint64) *Args { return a.add(binary.LittleEndian.AppendUint64(nil, v)) }

// I64 appends a signed 64-bit integer.
func (a *Args) I64(v int64) *Args { return a.U64(uint64(v)) }

// U32 appends a 32-bit integer.
func (a *Args) U32(v uint32) *Args { return a.add(binary.LittleEndian.AppendUint32(nil, v)) }

// F32 appends a float.
func (a *Args) F32(v float32) *Args { return a.U32(math.Float32bits(v)) }

// Bytes appends a parameter passed by value whose layout the caller built
// (a struct; see BatchLayout). At least one byte.
func (a *Args) Bytes(b []byte) *Args {
	if len(b) == 0 {
		b = []byte{0}
	}
	return a.add(b)
}

// Len is the number of arguments.
func (a *Args) Len() int { return len(a.vals) }

// pointers is the void*[] cuLaunchKernel reads.
func (a *Args) pointers() []unsafe.Pointer {
	if a == nil {
		return nil
	}
	p := make([]unsafe.Pointer, len(a.vals))
	for i, v := range a.vals {
		p[i] = unsafe.Pointer(&v[0])
	}
	return p
}
