package fault

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"unsafe"
)

// TestCatchTruncatedMapping maps a file, truncates it and touches the pages
// beyond the new end: a SIGBUS the Go runtime would make fatal becomes an
// error naming the address, for reads, writes and copy.
func TestCatchTruncatedMapping(t *testing.T) {
	const size = 4 * 4096
	f, err := os.OpenFile(filepath.Join(t.TempDir(), "seg"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	if err := f.Truncate(4096); err != nil {
		t.Fatal(err)
	}
	var sink byte
	cases := []struct {
		name string
		f    func()
	}{
		{"read", func() { sink += mem[2*4096] }},
		{"write", func() { mem[3*4096+5] = 1 }},
		{"copy", func() { copy(mem[4096:], make([]byte, 3*4096)) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := Catch(c.f)
			var fe *Error
			if !errors.As(err, &fe) {
				t.Fatalf("got %v, want a fault", err)
			}
			lo := uintptr(unsafe.Pointer(&mem[0])) + 4096
			if fe.Addr < lo || fe.Addr >= lo+3*4096 {
				t.Errorf("fault address %#x outside the truncated pages [%#x, %#x)", fe.Addr, lo, lo+3*4096)
			}
		})
	}
	// The first page is still there.
	if err := Catch(func() { mem[0] = 7 }); err != nil {
		t.Fatalf("valid page: %v", err)
	}
	_ = sink
}

func TestCatchPassesOtherPanics(t *testing.T) {
	defer func() {
		if r := recover(); r != "boom" {
			t.Fatalf("recovered %v, want the original panic", r)
		}
	}()
	_ = Catch(func() { panic("boom") })
}

func TestCatchNoFault(t *testing.T) {
	if err := Catch(func() {}); err != nil {
		t.Fatal(err)
	}
}
