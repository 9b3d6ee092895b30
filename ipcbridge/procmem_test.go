package ipcbridge

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"unsafe"

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

// TestCheckPages: the check passes over present pages (the page map's path),
// over pages never touched (proven by a read), and fails at an unmapped page
// wherever it lies in the range, with or without the page map.
func TestCheckPages(t *testing.T) {
	pg := os.Getpagesize()
	mem := halfTouched(t, 64)
	base := addrOf(mem)
	// A hole of one page in the middle of a second mapping.
	holed, err := unix.Mmap(-1, 0, 8*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(holed)
	for i := range holed {
		holed[i] = 2
	}
	if err := unix.MunmapPtr(unsafe.Pointer(&holed[5*pg]), uintptr(pg)); err != nil {
		t.Fatal(err)
	}
	hbase := addrOf(holed)
	for _, pagemap := range []bool{true, false} {
		p := &ProcessMemory{pid: os.Getpid()}
		if !pagemap {
			p.mapOnce.Do(func() {}) // as where /proc/PID/pagemap cannot be opened
		} else if p.pageMap() == nil {
			t.Fatal("cannot open this process's page map")
		} else { // the premise: touched pages show present, untouched ones do not
			for _, c := range []struct {
				at      uint64
				present bool
			}{{base, true}, {base + uint64(31*pg), true}, {base + uint64(33*pg), false}} {
				e := make([]byte, 8)
				if _, err := p.pageMap().ReadAt(e, int64(c.at/uint64(pg)*8)); err != nil {
					t.Fatal(err)
				}
				if got := binary.NativeEndian.Uint64(e)&pagePresent != 0; got != c.present {
					t.Errorf("page map entry of 0x%x: present=%v, want %v", c.at, got, c.present)
				}
			}
		}
		for _, tc := range []struct {
			name string
			addr uint64
			n    int64
			ok   bool
		}{
			{"present", base + 7, int64(32*pg - 7), true},
			{"untouched", base + uint64(32*pg), int64(32 * pg), true},
			{"both", base + 100, int64(64*pg - 200), true},
			{"one byte", base + uint64(40*pg), 1, true},
			{"before the hole", hbase, int64(5 * pg), true},
			{"into the hole", hbase + uint64(4*pg), int64(pg + 1), false},
			{"across the hole", hbase, int64(8 * pg), false},
			{"in the hole", hbase + uint64(5*pg) + 10, 10, false},
		} {
			err := p.Check(tc.addr, tc.n)
			if (err == nil) != tc.ok {
				t.Errorf("pagemap=%v %s: %v", pagemap, tc.name, err)
			}
			if err != nil && !strings.Contains(err.Error(), "not mapped") {
				t.Errorf("pagemap=%v %s: unclear error %v", pagemap, tc.name, err)
			}
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPagesChecksEachPageOnce: a set of proven pages passes ranges within
// pages it proved without asking again (shown by unmapping a proven page: the
// set still passes it, a fresh check fails), proves new pages as Check does,
// remembers nothing of a range that failed, and leaves ranges of
// maxRemembered pages or more to Check every time.
func TestPagesChecksEachPageOnce(t *testing.T) {
	pg := os.Getpagesize()
	mem := halfTouched(t, 40)
	base := addrOf(mem)
	p := &ProcessMemory{pid: os.Getpid()}
	s := p.Pages()
	unmap := func(page int) {
		t.Helper()
		if err := unix.MunmapPtr(unsafe.Pointer(&mem[page*pg]), uintptr(pg)); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name   string
		before func()
		addr   uint64
		n      int64
		ok     bool
	}{
		{"a small range on page 1", nil, base + uint64(pg) + 8, 64, true},
		{"page 1 again, after it was unmapped", func() { unmap(1) }, base + uint64(pg) + 200, 100, true},
		{"pages 2-3, never proven", nil, base + uint64(2*pg) + 10, int64(pg), true},
		{"an untouched page", nil, base + uint64(30*pg), 16, true},
		{"unmapped page 5, never proven", func() { unmap(5) }, base + uint64(4*pg), int64(2 * pg), false},
		{"page 4 alone: not remembered from the failed range", func() { unmap(4) }, base + uint64(4*pg), 8, false},
		{"a long range through unmapped page 1: checked whole", nil, base, int64(maxRemembered * pg), false},
	} {
		if tc.before != nil {
			tc.before()
		}
		err := s.Check(tc.addr, tc.n)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.name, err)
		}
		if err != nil && !strings.Contains(err.Error(), "not mapped") {
			t.Errorf("%s: unclear error %v", tc.name, err)
		}
	}
	if err := p.Check(base+uint64(pg)+8, 64); err == nil {
		t.Error("a fresh check passed unmapped page 1")
	}
}

// halfTouched maps pages of anonymous memory for the test, the first half
// written (present), the second never touched.
func halfTouched(t *testing.T, pages int) []byte {
	t.Helper()
	pg := os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, pages*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	for i := 0; i < pages/2*pg; i += pg {
		mem[i] = 1
	}
	return mem
}
