package ipcbridge

import (
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"github.com/sonar-moe/sonar/cuda"
)

// This file is the GPU backend: a client's CUDA memory, named by a CUDA IPC
// handle, opened in the server's context. Kernels need device addresses, not
// slices, so the GPU backend has its own small interfaces next to Mapper and
// Mapping: a DeviceMapping is one base allocation of the client (the
// cudaMalloc block torch's caching allocator carved the tensor from), and
// Ptr bounds-checks a range of it exactly as Mapping.Bytes does.

// DeviceMapping is GPU memory shared by a client.
type DeviceMapping interface {
	// Name identifies the mapping ("cuda:" and the start of the handle).
	Name() string
	// Size is the allocation's length in bytes, as the driver reports it.
	Size() int64
	// Ptr returns the device address of [off, off+n), or an error when that
	// range is not inside the allocation or off is not aligned to align.
	Ptr(off, n, align int64) (cuda.DevicePtr, error)
	// Close gives the allocation back; addresses from Ptr must not be used
	// after (by kernels queued later, either).
	Close() error
}

// DeviceMapper attaches to GPU memory a client names by an IPC handle.
type DeviceMapper interface {
	// MapDevice opens the allocation handle names: torch's shareable handle
	// (UntypedStorage._share_cuda_()[1]) or a raw 64-byte cudaIpcMemHandle_t.
	// size > 0 is the number of bytes the client will use from the start of
	// the allocation; it must fit.
	MapDevice(handle []byte, size int64) (DeviceMapping, error)
}

// ipcCache is what CUDAMapper needs of cuda.IPCCache.
type ipcCache interface {
	Acquire(h cuda.IPCMemHandle) (cuda.DevicePtr, int64, error)
	Release(h cuda.IPCMemHandle) error
}

// CUDAMapper maps client GPU memory through a cache that opens every base
// allocation once, however many tensors and requests refer to it.
type CUDAMapper struct {
	cache ipcCache
}

// NewCUDAMapper returns a mapper over cache (a *cuda.IPCCache of the
// server's device, or a test's stand-in).
func NewCUDAMapper(cache ipcCache) *CUDAMapper { return &CUDAMapper{cache: cache} }

// MapDevice implements DeviceMapper.
func (m *CUDAMapper) MapDevice(handle []byte, size int64) (DeviceMapping, error) {
	h, err := cuda.ParseTorchHandle(handle)
	if err != nil {
		return nil, err
	}
	name := "cuda:" + hex.EncodeToString(h.Reserved[:8])
	if size < 0 || size > MaxSegmentBytes {
		return nil, fmt.Errorf("allocation %s: size %d out of range (0..%d)", name, size, MaxSegmentBytes)
	}
	base, real, err := m.cache.Acquire(h)
	if err != nil {
		return nil, fmt.Errorf("allocation %s: %w", name, err)
	}
	if real <= 0 || size > real {
		err := fmt.Errorf("allocation %s is %d bytes, client said %d", name, real, size)
		if rerr := m.cache.Release(h); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	return &cudaMapping{cache: m.cache, h: h, name: name, base: base, size: real}, nil
}

type cudaMapping struct {
	cache  ipcCache
	h      cuda.IPCMemHandle
	name   string
	base   cuda.DevicePtr
	size   int64
	mu     sync.Mutex
	closed bool
}

func (c *cudaMapping) Name() string { return c.name }
func (c *cudaMapping) Size() int64  { return c.size }

func (c *cudaMapping) Ptr(off, n, align int64) (cuda.DevicePtr, error) {
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if err := checkRange("allocation", c.name, c.size, closed, off, n, align); err != nil {
		return 0, err
	}
	return c.base + cuda.DevicePtr(off), nil
}

func (c *cudaMapping) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if err := c.cache.Release(c.h); err != nil {
		return fmt.Errorf("releasing %s: %w", c.name, err)
	}
	return nil
}
