package ipcbridge

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ProcessMemory reads another process's memory with process_vm_readv(2): the
// gradients of a client on this machine, where autograd left them, with no
// copy into shared memory on the client's side. The server learns the pid
// from the connection (SO_PEERCRED), never from the client, and can only
// read: a client that names a bad address gets an error, not a crash.
//
// The kernel allows it to a process that may ptrace the client: the same
// user, and on Yama ptrace_scope 1 a client that named the server with
// prctl(PR_SET_PTRACER) (sonar_moe does for the private sonard it starts).
type ProcessMemory struct {
	pid int
}

// OpenProcess returns the memory of process pid and proves it readable:
// the probe bytes must be found at addr.
func OpenProcess(pid int, addr uint64, probe []byte) (*ProcessMemory, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("process memory: no process id (%d)", pid)
	}
	if len(probe) == 0 {
		return nil, errors.New("process memory: empty probe")
	}
	p := &ProcessMemory{pid: pid}
	got := make([]byte, len(probe))
	if err := p.ReadAt(got, addr); err != nil {
		return nil, err
	}
	if !bytes.Equal(got, probe) {
		return nil, fmt.Errorf("process memory: process %d does not hold the probe at 0x%x (is it the client?)", pid, addr)
	}
	return p, nil
}

// PID is the process read.
func (p *ProcessMemory) PID() int { return p.pid }

// ReadAt copies len(dst) bytes at addr of the process into dst; anything
// short of all of them is an error.
func (p *ProcessMemory) ReadAt(dst []byte, addr uint64) error {
	for len(dst) > 0 {
		local := []unix.Iovec{{Base: &dst[0]}}
		local[0].SetLen(len(dst))
		remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(dst)}}
		n, err := unix.ProcessVMReadv(p.pid, local, remote, 0)
		if err != nil {
			return p.explain(err, addr, len(dst))
		}
		if n <= 0 {
			return fmt.Errorf("process memory: read of %d bytes at 0x%x of process %d returned %d", len(dst), addr, p.pid, n)
		}
		dst, addr = dst[n:], addr+uint64(n)
	}
	return nil
}

// Check proves every page of [addr, addr+n) readable (one byte of each,
// IOV_MAX pages per system call), so that an update reading the range
// later does not stop half way for a bad address of an honest mistake.
func (p *ProcessMemory) Check(addr uint64, n int64) error {
	if n <= 0 {
		return nil
	}
	if addr+uint64(n) < addr {
		return fmt.Errorf("process memory: range 0x%x+%d wraps around", addr, n)
	}
	page := uint64(os.Getpagesize())
	const batch = 1024 // IOV_MAX
	sink := make([]byte, batch)
	local := []unix.Iovec{{Base: &sink[0]}}
	remote := make([]unix.RemoteIovec, 0, batch)
	end := addr + uint64(n)
	flush := func() error {
		if len(remote) == 0 {
			return nil
		}
		local[0].SetLen(len(remote))
		got, err := unix.ProcessVMReadv(p.pid, local, remote, 0)
		if err == nil && got < len(remote) {
			err = unix.EFAULT
		}
		if err != nil {
			at := remote[0].Base
			if got >= 0 && got < len(remote) {
				at = remote[got].Base
			}
			return p.explain(err, uint64(at), 1)
		}
		remote = remote[:0]
		return nil
	}
	for a := addr; a < end; a = (a/page + 1) * page {
		remote = append(remote, unix.RemoteIovec{Base: uintptr(a), Len: 1})
		if len(remote) == batch {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

func (p *ProcessMemory) explain(err error, addr uint64, n int) error {
	switch {
	case errors.Is(err, unix.EFAULT):
		return fmt.Errorf("process memory: bytes 0x%x+%d are not mapped in process %d: %w", addr, n, p.pid, err)
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("process memory: reading process %d is not permitted (the same user is needed, and on "+
			"Yama ptrace_scope 1 the client must allow this process with prctl(PR_SET_PTRACER)): %w", p.pid, err)
	case errors.Is(err, unix.ESRCH):
		return fmt.Errorf("process memory: process %d is gone: %w", p.pid, err)
	}
	return fmt.Errorf("process memory: reading %d bytes at 0x%x of process %d: %w", n, addr, p.pid, err)
}

// addrOf is the address of b's first byte (tests read their own memory).
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }
