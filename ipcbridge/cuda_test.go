package ipcbridge

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
)

// fakeDevice stands in for the CUDA device behind cuda.IPCCache: handle
// byte 0 picks the base address, byte 1 the size in KiB.
type fakeDevice struct {
	open map[cuda.DevicePtr]int
	fail bool
}

func (f *fakeDevice) OpenIPCMem(h cuda.IPCMemHandle) (cuda.DevicePtr, int64, error) {
	if f.fail {
		return 0, 0, &cuda.Error{Op: "cuIpcOpenMemHandle_v2", Code: cuda.ErrorInvalidValue}
	}
	p := cuda.DevicePtr(h.Reserved[0]) << 32
	f.open[p]++
	return p, int64(h.Reserved[1]) << 10, nil
}

func (f *fakeDevice) CloseIPCMem(p cuda.DevicePtr) error {
	if f.open[p] == 0 {
		return errors.New("not open")
	}
	f.open[p]--
	return nil
}

func torchHandle(id, kib byte) []byte {
	b := make([]byte, 66)
	b[0], b[1] = 2, 'c' // torch's shareable-handle version 2, cudaMalloc block
	b[2], b[3] = id, kib
	return b
}

func newTestMapper(maxIdle int) (*CUDAMapper, *cuda.IPCCache, *fakeDevice) {
	f := &fakeDevice{open: map[cuda.DevicePtr]int{}}
	c := cuda.NewIPCCache(f, maxIdle)
	return NewCUDAMapper(c), c, f
}

func TestCUDAMapPtrChecks(t *testing.T) {
	m, _, _ := newTestMapper(4)
	dm, err := m.MapDevice(torchHandle(1, 16), 8192) // a 16 KiB block, the client uses 8 KiB
	if err != nil {
		t.Fatal(err)
	}
	defer dm.Close()
	if dm.Size() != 16384 || !strings.HasPrefix(dm.Name(), "cuda:01") {
		t.Errorf("Size %d Name %q", dm.Size(), dm.Name())
	}
	const base = cuda.DevicePtr(1) << 32
	tests := []struct {
		name         string
		off, n, algn int64
		want         cuda.DevicePtr
		err          string
	}{
		{"start", 0, 4, 4, base, ""},
		{"middle", 4096, 1024, 4, base + 4096, ""},
		{"whole block", 0, 16384, 1, base, ""},
		{"last byte", 16383, 1, 1, base + 16383, ""},
		{"bf16 aligned", 2, 2, 2, base + 2, ""},
		{"past the end", 16380, 8, 4, 0, "outside its 16384 bytes"},
		{"offset past the end", 16385, 1, 1, 0, "outside"},
		{"negative offset", -4, 4, 4, 0, "invalid"},
		{"empty range", 0, 0, 4, 0, "invalid"},
		{"overflow", 8, math.MaxInt64, 1, 0, "outside"},
		{"misaligned float32", 6, 4, 4, 0, "not aligned to 4"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := dm.Ptr(tc.off, tc.n, tc.algn)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || p != tc.want {
				t.Fatalf("Ptr = %#x, %v; want %#x", p, err, tc.want)
			}
		})
	}
}

func TestCUDAMapSharesBaseBlocks(t *testing.T) {
	m, c, f := newTestMapper(1)
	// Two tensors in one block (e.g. a parameter and its neighbour), one in another.
	a, err := m.MapDevice(torchHandle(1, 64), 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.MapDevice(torchHandle(1, 64), 4096)
	if err != nil {
		t.Fatal(err)
	}
	g, err := m.MapDevice(torchHandle(2, 64), 0)
	if err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.Opens != 2 || st.Open != 2 {
		t.Errorf("stats %+v: block 1 must be opened once", st)
	}
	pa, _ := a.Ptr(0, 4, 4)
	pb, _ := b.Ptr(0, 4, 4)
	if pa != pb {
		t.Errorf("one block, two addresses: %#x %#x", pa, pb)
	}
	for _, dm := range []DeviceMapping{a, g} {
		if err := dm.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Close(); err != nil { // Close is idempotent
		t.Fatal(err)
	}
	if _, err := a.Ptr(0, 4, 4); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Ptr after Close: %v", err)
	}
	// b still holds block 1; block 2 is idle (maxIdle 1 keeps it).
	if st := c.Stats(); st.Open != 2 || st.Idle != 1 || f.open[cuda.DevicePtr(1)<<32] != 1 {
		t.Errorf("stats %+v", st)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.Open != 1 || st.Idle != 1 {
		t.Errorf("after the last release: %+v (LRU keeps one idle block)", st)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for p, n := range f.open {
		if n != 0 {
			t.Errorf("block %#x still open %d times", p, n)
		}
	}
}

func TestCUDAMapErrors(t *testing.T) {
	tests := []struct {
		name   string
		handle []byte
		size   int64
		fail   bool
		err    string
	}{
		{"client size larger than the block", torchHandle(3, 4), 8192, false, "is 4096 bytes, client said 8192"},
		{"negative size", torchHandle(3, 4), -1, false, "out of range"},
		{"expandable segment", append([]byte{2, 'e'}, make([]byte, 80)...), 0, false, "expandable"},
		{"garbage handle", []byte("xyz"), 0, false, "unknown format"},
		{"driver refuses", torchHandle(3, 4), 0, true, "CUDA_ERROR_INVALID_VALUE"},
		{"empty block", torchHandle(3, 0), 0, false, "is 0 bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, c, f := newTestMapper(0)
			f.fail = tc.fail
			if _, err := m.MapDevice(tc.handle, tc.size); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err = %v, want %q", err, tc.err)
			}
			if st := c.Stats(); st.Open != 0 {
				t.Errorf("a failed map left %d allocations open", st.Open)
			}
		})
	}
}

func TestCUDAMappingInterfaces(t *testing.T) {
	var _ DeviceMapper = (*CUDAMapper)(nil)
	var _ DeviceMapping = (*cudaMapping)(nil)
}
