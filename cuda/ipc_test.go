package cuda

import (
	"errors"
	"strings"
	"sync"
	"testing"
)

// fakeOpener hands out addresses from the handle's first byte and records
// every open and close.
type fakeOpener struct {
	mu      sync.Mutex
	open    map[DevicePtr]bool
	opens   int
	closes  int
	failOn  byte // OpenIPCMem fails for handles starting with this byte (0: never)
	failCls bool
}

func newFakeOpener() *fakeOpener { return &fakeOpener{open: map[DevicePtr]bool{}} }

func (f *fakeOpener) OpenIPCMem(h IPCMemHandle) (DevicePtr, int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failOn != 0 && h.Reserved[0] == f.failOn {
		return 0, 0, &Error{Op: "cuIpcOpenMemHandle_v2", Code: ErrorInvalidValue}
	}
	p := DevicePtr(h.Reserved[0]) << 20
	if f.open[p] {
		return 0, 0, &Error{Op: "cuIpcOpenMemHandle_v2", Code: ErrorAlreadyMapped} // as the driver: once per context
	}
	f.open[p] = true
	f.opens++
	return p, int64(h.Reserved[1]) * 4096, nil
}

func (f *fakeOpener) CloseIPCMem(p DevicePtr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.open[p] {
		return errors.New("close of a pointer that is not open")
	}
	delete(f.open, p)
	f.closes++
	if f.failCls {
		return errors.New("close failed")
	}
	return nil
}

func handle(id, pages byte) IPCMemHandle {
	var h IPCMemHandle
	h.Reserved[0], h.Reserved[1] = id, pages
	h.Reserved[63] = 0x5a
	return h
}

func TestIPCCacheSequences(t *testing.T) {
	type op struct {
		acquire bool
		id      byte
	}
	acq := func(id byte) op { return op{true, id} }
	rel := func(id byte) op { return op{false, id} }
	tests := []struct {
		name           string
		maxIdle        int
		ops            []op
		opens, closes  int
		openNow, idle  int
		releaseErrLast bool
	}{
		{"one tensor", 4, []op{acq(1), rel(1)}, 1, 0, 1, 1, false},
		{"many tensors in one block open it once", 4, []op{acq(1), acq(1), acq(1), rel(1), rel(1), rel(1)}, 1, 0, 1, 1, false},
		{"reuse after release is a hit", 4, []op{acq(1), rel(1), acq(1), rel(1), acq(1)}, 1, 0, 1, 0, false},
		{"maxIdle 0 closes at once", 0, []op{acq(1), rel(1), acq(1), rel(1)}, 2, 2, 0, 0, false},
		{"LRU evicts the oldest idle", 2, []op{acq(1), acq(2), acq(3), rel(1), rel(2), rel(3)}, 3, 1, 2, 2, false},
		{"in-use blocks are never evicted", 1, []op{acq(1), acq(2), acq(3), rel(3), rel(2)}, 3, 1, 2, 1, false},
		{"a re-acquired idle block leaves the LRU", 1, []op{acq(1), rel(1), acq(1), acq(2), rel(2), rel(1)}, 2, 1, 1, 1, false},
		{"release without acquire fails", 4, []op{acq(1), rel(1), rel(1)}, 1, 0, 1, 1, true},
		{"release of unknown handle fails", 4, []op{rel(9)}, 0, 0, 0, 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeOpener()
			c := NewIPCCache(f, tc.maxIdle)
			var lastErr error
			for i, o := range tc.ops {
				if o.acquire {
					p, size, err := c.Acquire(handle(o.id, 2))
					if err != nil {
						t.Fatalf("op %d: %v", i, err)
					}
					if p != DevicePtr(o.id)<<20 || size != 8192 {
						t.Fatalf("op %d: Acquire = %#x, %d", i, p, size)
					}
				} else {
					lastErr = c.Release(handle(o.id, 2))
					if lastErr != nil && !tc.releaseErrLast {
						t.Fatalf("op %d: %v", i, lastErr)
					}
				}
			}
			if tc.releaseErrLast && lastErr == nil {
				t.Error("the last release should have failed")
			}
			st := c.Stats()
			if f.opens != tc.opens || f.closes != tc.closes || st.Open != tc.openNow || st.Idle != tc.idle {
				t.Errorf("opens %d closes %d open %d idle %d; want %d %d %d %d", f.opens, f.closes, st.Open, st.Idle,
					tc.opens, tc.closes, tc.openNow, tc.idle)
			}
			if st.Opens != int64(f.opens) || st.Bytes != int64(st.Open)*8192 {
				t.Errorf("stats %+v", st)
			}
			if err := c.Close(); err != nil {
				t.Error(err)
			}
			if len(f.open) != 0 {
				t.Errorf("Close left %d mappings open", len(f.open))
			}
			if _, _, err := c.Acquire(handle(1, 1)); !errors.Is(err, ErrCacheClosed) {
				t.Errorf("Acquire after Close: %v", err)
			}
		})
	}
}

func TestIPCCacheOpenFailureCachesNothing(t *testing.T) {
	f := newFakeOpener()
	f.failOn = 7
	c := NewIPCCache(f, 4)
	if _, _, err := c.Acquire(handle(7, 1)); CodeOf(err) != ErrorInvalidValue {
		t.Fatalf("err = %v", err)
	}
	f.failOn = 0
	if _, _, err := c.Acquire(handle(7, 1)); err != nil {
		t.Fatalf("retry after a failed open: %v", err)
	}
	if st := c.Stats(); st.Open != 1 || st.Opens != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestIPCCacheTrimAndCloseErrors(t *testing.T) {
	f := newFakeOpener()
	c := NewIPCCache(f, 8)
	for id := byte(1); id <= 3; id++ {
		if _, _, err := c.Acquire(handle(id, 1)); err != nil {
			t.Fatal(err)
		}
	}
	_ = c.Release(handle(1, 1))
	_ = c.Release(handle(2, 1))
	if err := c.Trim(); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.Open != 1 || st.Idle != 0 || f.closes != 2 {
		t.Errorf("after Trim: %+v closes %d", st, f.closes)
	}
	f.failCls = true
	if err := c.Close(); err == nil || !strings.Contains(err.Error(), "close failed") {
		t.Errorf("Close error = %v", err)
	}
}

func TestIPCCacheConcurrent(t *testing.T) {
	f := newFakeOpener()
	c := NewIPCCache(f, 2)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				h := handle(byte(1+(g+i)%5), 1)
				if _, _, err := c.Acquire(h); err != nil {
					t.Error(err)
					return
				}
				if err := c.Release(h); err != nil {
					t.Error(err)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	if st := c.Stats(); st.Open > 2 || st.Idle != st.Open {
		t.Errorf("stats %+v", st)
	}
	if err := c.Close(); err != nil {
		t.Error(err)
	}
}

func TestParseTorchHandle(t *testing.T) {
	raw := make([]byte, 64)
	for i := range raw {
		raw[i] = byte(i + 1)
	}
	withPrefix := func(ver, typ byte) []byte { return append([]byte{ver, typ}, raw...) }
	tests := []struct {
		name string
		in   []byte
		err  string
	}{
		{"raw 64 bytes (old torch)", raw, ""},
		{"torch <= 2.12 (version 2)", withPrefix(2, 'c'), ""},
		{"version 1", withPrefix(1, 'c'), ""},
		{"torch 2.13 (version 3)", withPrefix(3, 'c'), ""},
		{"unknown version", withPrefix(9, 'c'), "version 9"},
		{"expandable segment", append([]byte{2, 'e'}, make([]byte, 100)...), "expandable"},
		{"short", raw[:10], "unknown format"},
		{"empty", nil, "unknown format"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseTorchHandle(tc.in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(h.Reserved[:]) != string(raw) {
				t.Errorf("handle %x", h.Reserved)
			}
		})
	}
}
