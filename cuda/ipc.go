package cuda

import (
	"container/list"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
)

// MemOpener opens and closes IPC memory handles; *Device is one, tests use fakes.
type MemOpener interface {
	// OpenIPCMem maps the allocation h names and returns its base and size.
	OpenIPCMem(h IPCMemHandle) (DevicePtr, int64, error)
	// CloseIPCMem unmaps memory OpenIPCMem returned.
	CloseIPCMem(p DevicePtr) error
}

// IPCCache opens each base allocation of a client once, however many tensors
// live in it, and keeps it open while anything uses it. The CUDA driver
// refuses to open a handle a second time in one context, and opening costs
// far more than a lookup, so the cache is keyed by the handle's bytes (a
// handle names one cudaMalloc block of the exporting process).
//
// Each Acquire must be paired with a Release. An allocation nobody uses
// stays open, in least-recently-used order, while there are at most MaxIdle
// of them (a trainer's caching allocator hands out the same blocks again in
// the next step, so reopening them would be waste); beyond that the oldest
// is closed. Keep MaxIdle small: an exporter's cudaFree does not return the
// memory to the device while this process still has it open.
type IPCCache struct {
	mu      sync.Mutex
	opener  MemOpener
	maxIdle int
	entries map[IPCMemHandle]*ipcEntry
	idle    *list.List // of *ipcEntry with refs == 0, most recently released at the back
	opens   int64
	closed  bool
}

type ipcEntry struct {
	h    IPCMemHandle
	base DevicePtr
	size int64
	refs int
	elem *list.Element // in idle, when refs == 0
}

// NewIPCCache returns a cache that opens handles with opener and keeps at
// most maxIdle unused allocations open (0: close as soon as unused).
func NewIPCCache(opener MemOpener, maxIdle int) *IPCCache {
	return &IPCCache{opener: opener, maxIdle: max(maxIdle, 0), entries: map[IPCMemHandle]*ipcEntry{}, idle: list.New()}
}

// ErrCacheClosed is returned by Acquire after Close.
var ErrCacheClosed = errors.New("cuda: IPC cache is closed")

// Acquire returns the base and size of the allocation h names, opening it
// if it is not open yet.
func (c *IPCCache) Acquire(h IPCMemHandle) (DevicePtr, int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, 0, ErrCacheClosed
	}
	if e := c.entries[h]; e != nil {
		if e.refs == 0 {
			c.idle.Remove(e.elem)
			e.elem = nil
		}
		e.refs++
		return e.base, e.size, nil
	}
	base, size, err := c.opener.OpenIPCMem(h)
	if err != nil {
		return 0, 0, err
	}
	c.opens++
	c.entries[h] = &ipcEntry{h: h, base: base, size: size, refs: 1}
	return base, size, nil
}

// Release gives back one Acquire of h. The allocation stays open as long as
// the idle limit allows; errors come from closing evicted allocations.
func (c *IPCCache) Release(h IPCMemHandle) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[h]
	if e == nil || e.refs == 0 {
		return fmt.Errorf("cuda: release of IPC handle %v that is not acquired", h)
	}
	e.refs--
	if e.refs > 0 {
		return nil
	}
	e.elem = c.idle.PushBack(e)
	return c.trim(c.maxIdle)
}

// trim closes the least recently released idle allocations until at most
// keep remain.
func (c *IPCCache) trim(keep int) error {
	var errs []error
	for c.idle.Len() > keep {
		e := c.idle.Remove(c.idle.Front()).(*ipcEntry)
		delete(c.entries, e.h)
		if err := c.opener.CloseIPCMem(e.base); err != nil {
			errs = append(errs, fmt.Errorf("closing IPC handle %s: %w", hex.EncodeToString(e.h.Reserved[:8]), err))
		}
	}
	return errors.Join(errs...)
}

// Trim closes every allocation nobody uses (e.g. when a client says it is
// about to free cached memory).
func (c *IPCCache) Trim() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.trim(0)
}

// Close closes every allocation, in use or not, and refuses later Acquires.
func (c *IPCCache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	var errs []error
	for h, e := range c.entries {
		if err := c.opener.CloseIPCMem(e.base); err != nil {
			errs = append(errs, fmt.Errorf("closing IPC handle %v: %w", h, err))
		}
	}
	c.entries = map[IPCMemHandle]*ipcEntry{}
	c.idle.Init()
	return errors.Join(errs...)
}

// IPCCacheStats are the cache's counters.
type IPCCacheStats struct {
	Open  int   // allocations open now
	Idle  int   // of which nobody uses
	Bytes int64 // their total size
	Opens int64 // handles opened since the start
}

// Stats reports the cache's counters.
func (c *IPCCache) Stats() IPCCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := IPCCacheStats{Open: len(c.entries), Idle: c.idle.Len(), Opens: c.opens}
	for _, e := range c.entries {
		st.Bytes += e.size
	}
	return st
}

// Torch's shareable-handle format (c10/cuda/CUDACachingAllocator.cpp,
// shareIpcHandle): a version byte, a type byte, then the payload; for
// memory from cudaMalloc the type is 'c' and the payload is the 64-byte
// cudaIpcMemHandle_t of the block's base. Versions 1 and 2 (torch <= 2.12)
// and 3 (torch 2.13) have the same 'c' payload. Older torch sent the raw
// 64 bytes.
const (
	torchHandleCudaMalloc        = 'c'
	torchHandleExpandableSegment = 'e'
)

// ParseTorchHandle extracts the CUDA IPC handle from the bytes torch's
// UntypedStorage._share_cuda_() returns as its handle (or from a raw
// 64-byte cudaIpcMemHandle_t).
func ParseTorchHandle(b []byte) (IPCMemHandle, error) {
	var h IPCMemHandle
	switch {
	case len(b) == len(h.Reserved):
		copy(h.Reserved[:], b)
		return h, nil
	case len(b) >= 2 && b[1] == torchHandleExpandableSegment:
		return h, errors.New("cuda: the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which cannot be shared over CUDA IPC handles: turn expandable segments off")
	case len(b) == 2+len(h.Reserved) && b[1] == torchHandleCudaMalloc:
		if b[0] < 1 || b[0] > 3 {
			return h, fmt.Errorf("cuda: torch IPC handle version %d not supported (1..3)", b[0])
		}
		copy(h.Reserved[:], b[2:])
		return h, nil
	}
	return h, fmt.Errorf("cuda: %d-byte IPC handle in an unknown format (want 64 raw bytes, or 66 from torch)", len(b))
}
