package ipcbridge

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
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
	pid     int
	mapOnce sync.Once
	pagemap *os.File // nil until the first Check, and where it cannot be opened
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

// Check proves every page of [addr, addr+n) readable, so that an update
// reading the range later does not stop half way for a bad address of an
// honest mistake.
//
// The process's page map (/proc/PID/pagemap, readable to whoever may read
// the process) says which pages are present in memory: a present page is
// mapped, and every page of a gradient autograd has just written is. Only
// the pages it does not show present (never touched, swapped out, or not
// mapped at all) are proven by reading one byte of each (IOV_MAX pages per
// system call), which costs a page-table walk and a pin per page. Without a
// page map (another kernel, or a sandbox without it), every page is read so.
func (p *ProcessMemory) Check(addr uint64, n int64) error {
	if n <= 0 {
		return nil
	}
	if addr+uint64(n) < addr {
		return fmt.Errorf("process memory: range 0x%x+%d wraps around", addr, n)
	}
	page := uint64(os.Getpagesize())
	first, last := addr/page, (addr+uint64(n)-1)/page
	probe := &pageProbe{p: p}
	if pm := p.pageMap(); pm != nil {
		const chunk = 4096 // entries (8 bytes each) per read
		ents := make([]byte, 8*min(chunk, last-first+1))
		for lo := first; lo <= last; lo += chunk {
			cnt := min(chunk, last-lo+1)
			got, err := pm.ReadAt(ents[:8*cnt], int64(lo*8))
			if err != nil && got == 0 && !errors.Is(err, io.EOF) {
				return p.checkEach(probe, addr, lo, last, page) // unreadable map: prove the rest page by page
			}
			for i := uint64(0); i < cnt; i++ {
				if int(8*i+8) <= got && binary.NativeEndian.Uint64(ents[8*i:])&pagePresent != 0 {
					continue
				}
				if err := probe.add(max(addr, (lo+i)*page)); err != nil {
					return err
				}
			}
		}
		return probe.flush()
	}
	return p.checkEach(probe, addr, first, last, page)
}

// Pages proves ranges of the process readable as Check does, each page once:
// the gradients of one step request that share pages (thousands of small
// expert tensors of a per-expert layout, a few to a page) read the page map
// once a page instead of once a tensor. It lives for one request: a page it
// proved may be unmapped later, as any range may between its check and its
// read.
type Pages struct {
	p      *ProcessMemory
	proven map[uint64]struct{}
}

// maxRemembered bounds the pages a range may span for Pages to remember them:
// larger ranges share few pages with others.
const maxRemembered = 16

// Pages starts a set of proven pages of the process.
func (p *ProcessMemory) Pages() *Pages { return &Pages{p: p, proven: map[uint64]struct{}{}} }

// Check is ProcessMemory.Check, skipped where every page of the range was
// proven by an earlier Check of the set.
func (s *Pages) Check(addr uint64, n int64) error {
	if n <= 0 || addr+uint64(n) < addr {
		return s.p.Check(addr, n)
	}
	page := uint64(os.Getpagesize())
	first, last := addr/page, (addr+uint64(n)-1)/page
	if last-first >= maxRemembered {
		return s.p.Check(addr, n)
	}
	known := true
	for pg := first; pg <= last && known; pg++ {
		_, known = s.proven[pg]
	}
	if known {
		return nil
	}
	if err := s.p.Check(addr, n); err != nil {
		return err
	}
	for pg := first; pg <= last; pg++ {
		s.proven[pg] = struct{}{}
	}
	return nil
}

// pagePresent is the page map entry's "present in memory" bit (bit 63).
const pagePresent = 1 << 63

// checkEach proves pages first..last readable one byte at a time.
func (p *ProcessMemory) checkEach(probe *pageProbe, addr, first, last, page uint64) error {
	for pg := first; pg <= last; pg++ {
		if err := probe.add(max(addr, pg*page)); err != nil {
			return err
		}
	}
	return probe.flush()
}

// pageMap is the process's /proc/PID/pagemap, opened at the first check; nil
// where it cannot be opened (then every page is proven by a read).
func (p *ProcessMemory) pageMap() *os.File {
	p.mapOnce.Do(func() {
		f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", p.pid))
		if err == nil {
			p.pagemap = f
		}
	})
	return p.pagemap
}

// Close releases the page map (the process's memory needs no closing).
func (p *ProcessMemory) Close() error {
	p.mapOnce.Do(func() {}) // no later check opens it
	if p.pagemap == nil {
		return nil
	}
	return p.pagemap.Close()
}

// pageProbe reads one byte at each address added, IOV_MAX addresses per
// system call.
type pageProbe struct {
	p      *ProcessMemory
	sink   []byte
	remote []unix.RemoteIovec
}

const iovMax = 1024

func (b *pageProbe) add(a uint64) error {
	b.remote = append(b.remote, unix.RemoteIovec{Base: uintptr(a), Len: 1})
	if len(b.remote) == iovMax {
		return b.flush()
	}
	return nil
}

func (b *pageProbe) flush() error {
	if len(b.remote) == 0 {
		return nil
	}
	if b.sink == nil {
		b.sink = make([]byte, iovMax)
	}
	local := []unix.Iovec{{Base: &b.sink[0]}}
	local[0].SetLen(len(b.remote))
	got, err := unix.ProcessVMReadv(b.p.pid, local, b.remote, 0)
	if err == nil && got < len(b.remote) {
		err = unix.EFAULT
	}
	if err != nil {
		at := b.remote[0].Base
		if got >= 0 && got < len(b.remote) {
			at = b.remote[got].Base
		}
		return b.p.explain(err, uint64(at), 1)
	}
	b.remote = b.remote[:0]
	return nil
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
