package goclient

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Segment is a POSIX shared-memory segment this process created and mapped.
type Segment struct {
	name, path string
	mem        []byte
}

// NewSegmentName returns a fresh name the server accepts:
// "sonar-go-<pid>-<random hex>".
func NewSegmentName() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("sonar-go-%d-%s", os.Getpid(), hex.EncodeToString(b[:]))
}

// CreateSegment creates a zero-filled segment of size bytes named name in
// dir ("" for /dev/shm) with mode 0600, refusing to reuse an existing file,
// and maps it shared.
func CreateSegment(dir, name string, size int) (*Segment, error) {
	if dir == "" {
		dir = "/dev/shm"
	}
	if size <= 0 {
		return nil, fmt.Errorf("goclient: segment %s: size %d", name, size)
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("goclient: create segment: %w", err)
	}
	defer f.Close()
	if err := f.Chmod(0o600); err != nil { // whatever the umask did
		os.Remove(path)
		return nil, fmt.Errorf("goclient: segment %s: %w", name, err)
	}
	// Reserve every page: sonard refuses sparse segments (a first touch of a
	// page could fault when the filesystem is full).
	if err := unix.Fallocate(int(f.Fd()), 0, 0, int64(size)); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("goclient: segment %s: %w", name, err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("goclient: map segment %s: %w", name, err)
	}
	return &Segment{name: name, path: path, mem: mem}, nil
}

// Name is the segment's shared-memory name.
func (s *Segment) Name() string { return s.name }

// Path is the segment's file (gone once a server has attached it).
func (s *Segment) Path() string { return s.path }

// Bytes is the mapped memory.
func (s *Segment) Bytes() []byte { return s.mem }

// Close unmaps the segment and removes its name if the server has not.
func (s *Segment) Close() error {
	var errs []error
	if s.mem != nil {
		if err := syscall.Munmap(s.mem); err != nil {
			errs = append(errs, fmt.Errorf("goclient: unmap %s: %w", s.name, err))
		}
		s.mem = nil
	}
	if err := os.Remove(s.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("goclient: remove %s: %w", s.name, err))
	}
	return errors.Join(errs...)
}
