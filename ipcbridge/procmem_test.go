package ipcbridge

import (
	"bytes"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The tests read this process's own memory: the kernel treats it like a
// client's (process_vm_readv with our own pid).
func TestProcessMemory(t *testing.T) {
	pid := os.Getpid()
	r := rand.New(rand.NewPCG(3, 4))
	data := make([]byte, 3*os.Getpagesize()+123)
	for i := range data {
		data[i] = byte(r.IntN(256))
	}
	probe := data[100:164]
	p, err := OpenProcess(pid, addrOf(probe), bytes.Clone(probe))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ off, n int }{{0, len(data)}, {1, 7}, {4095, 2}, {len(data) - 1, 1}} {
		got := make([]byte, tc.n)
		if err := p.ReadAt(got, addrOf(data)+uint64(tc.off)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data[tc.off:tc.off+tc.n]) {
			t.Fatalf("read of %d bytes at %d differs", tc.n, tc.off)
		}
	}
	if err := p.Check(addrOf(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}

	// An unmapped range: a clear error, from the read and from the check.
	hole, err := unix.Mmap(-1, 0, 4*os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	base := addrOf(hole)
	if err := unix.Munmap(hole); err != nil {
		t.Fatal(err)
	}
	for name, err := range map[string]error{
		"read":  p.ReadAt(make([]byte, 16), base),
		"check": p.Check(base, 4096),
		"probe": func() error { _, err := OpenProcess(pid, base, []byte{1}); return err }(),
	} {
		if err == nil || !strings.Contains(err.Error(), "not mapped") {
			t.Errorf("%s of unmapped memory: %v", name, err)
		}
	}
	// A range that starts mapped and ends in a hole fails the check.
	if err := p.Check(addrOf(data), 1<<40); err == nil {
		t.Error("check of a range past the mapping passed")
	}
	// The probe must be there.
	if _, err := OpenProcess(pid, addrOf(probe), []byte("not what is there")); err == nil ||
		!strings.Contains(err.Error(), "does not hold the probe") {
		t.Errorf("wrong probe: %v", err)
	}
	if _, err := OpenProcess(0, addrOf(probe), probe); err == nil {
		t.Error("pid 0 accepted")
	}
}
