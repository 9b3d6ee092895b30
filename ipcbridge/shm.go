// Package ipcbridge turns the handles a client sends into memory the server
// can read and write: POSIX shared memory (this file: files under /dev/shm,
// checked by name, owner, mode and size, mapped MAP_SHARED) behind Mapper and
// Mapping, and a client's CUDA allocations opened by IPC handle (cuda.go)
// behind DeviceMapper and DeviceMapping. Every access to either goes through
// one bounds check. The backends of package backend use these mappings.
package ipcbridge

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"syscall"

	"github.com/sonar-moe/sonar/internal/clip"
)

// Mapping is memory shared with a client.
type Mapping interface {
	// Name identifies the mapping (the shared-memory name).
	Name() string
	// Size is the mapping's length in bytes.
	Size() int64
	// Bytes returns [off, off+n) of the mapping, or an error when that range
	// is not inside it or not aligned to align bytes.
	Bytes(off, n int64, align int64) ([]byte, error)
	// Object identifies the memory object mapped (the file's device and
	// inode): two names or two attachments of one file are one object.
	Object() Object
	// Verify reports whether the memory is still all there: the file was
	// not truncated or had holes punched since it was mapped (an access to
	// a missing page is a SIGBUS).
	Verify() error
	// Close unmaps the memory. Slices returned by Bytes must not be used after.
	Close() error
}

// Object is the identity of a mapped file.
type Object struct{ Dev, Ino uint64 }

// Mapper attaches to memory a client names.
type Mapper interface {
	Map(name string, size int64) (Mapping, error)
}

// MaxSegmentBytes bounds a single shared-memory segment (1 TiB).
const MaxSegmentBytes = int64(1) << 40

var shmName = regexp.MustCompile(`^sonar-[A-Za-z0-9_.-]{1,200}$`)

// ShmMapper maps POSIX shared-memory segments from Dir (default /dev/shm).
// With Unlink set, each segment's name is removed once mapped: the server
// then owns the memory, and nothing is left behind whichever process dies.
type ShmMapper struct {
	Dir    string
	Unlink bool
}

// ErrName is returned for shared-memory names the server does not accept.
var ErrName = errors.New("shared-memory name not allowed")

// CheckName reports whether name is an acceptable segment name:
// "sonar-" followed by 1-200 of [A-Za-z0-9_.-], no path separators.
func CheckName(name string) error {
	if !shmName.MatchString(name) || name == "sonar-." || name == "sonar-.." {
		return fmt.Errorf("%w: %s (want sonar-[A-Za-z0-9_.-]{1,200})", ErrName, clip.Quote(name))
	}
	return nil
}

// Map opens, checks and maps the segment. It must be a regular file owned by
// this process's user, not a symlink, exactly size bytes long and with all
// its pages allocated (the client reserves them with posix_fallocate): a
// page of a sparse file is allocated on first access, and where the
// filesystem is full that access is a SIGBUS instead of an error.
// The mapping keeps the file open, to check before each use that the
// client did not shrink it since (Verify).
func (m ShmMapper) Map(name string, size int64) (Mapping, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	if size <= 0 || size > MaxSegmentBytes {
		return nil, fmt.Errorf("segment %q: size %d out of range (1..%d)", name, size, MaxSegmentBytes)
	}
	dir := m.Dir
	if dir == "" {
		dir = "/dev/shm"
	}
	path := filepath.Join(dir, name)
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open segment %q: %w", name, err)
	}
	keep := false
	defer func() {
		if !keep {
			_ = syscall.Close(fd)
		}
	}()
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat segment %q: %w", name, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, fmt.Errorf("segment %q is not a regular file", name)
	}
	if int(st.Uid) != os.Getuid() {
		return nil, fmt.Errorf("segment %q is owned by uid %d, not by the server's uid %d", name, st.Uid, os.Getuid())
	}
	if st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("segment %q has mode %o: group/other access not allowed", name, st.Mode&0o777)
	}
	if st.Size != size {
		return nil, fmt.Errorf("segment %q is %d bytes, client said %d", name, st.Size, size)
	}
	if err := allocated(name, &st); err != nil {
		return nil, err
	}
	data, err := syscall.Mmap(fd, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap segment %q: %w", name, err)
	}
	if m.Unlink {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			_ = syscall.Munmap(data)
			return nil, fmt.Errorf("unlink segment %q: %w", name, err)
		}
	}
	keep = true
	return &shmMapping{name: name, data: data, fd: fd, obj: Object{Dev: uint64(st.Dev), Ino: st.Ino}}, nil
}

// allocated reports an error when fewer bytes of the file are allocated than
// its size (st_blocks counts 512-byte units).
func allocated(name string, st *syscall.Stat_t) error {
	if have := st.Blocks * 512; have < st.Size {
		return fmt.Errorf("segment %q has %d of its %d bytes allocated: the client must reserve every page "+
			"(posix_fallocate), or an access to it faults when the filesystem is full", name, have, st.Size)
	}
	return nil
}

type shmMapping struct {
	name string
	data []byte
	// fd stays open while the segment is mapped: Verify fstats it before
	// each use, to refuse a request on memory the client truncated or
	// punched a hole in (touching it would be a SIGBUS). With Unlink the
	// name is gone, so the descriptor is the only way to the file left
	// (/proc/self/map_files needs CAP_SYS_ADMIN). Each attached segment
	// therefore costs a descriptor: the server bounds how many clients may
	// attach (server.Server.MaxSegments, package fdlimit).
	fd  int
	obj Object
}

func (s *shmMapping) Name() string   { return s.name }
func (s *shmMapping) Size() int64    { return int64(len(s.data)) }
func (s *shmMapping) Object() Object { return s.obj }

func (s *shmMapping) Verify() error {
	if s.data == nil {
		return fmt.Errorf("segment %q is closed", s.name)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(s.fd, &st); err != nil {
		return fmt.Errorf("stat segment %q: %w", s.name, err)
	}
	if st.Size < int64(len(s.data)) {
		return fmt.Errorf("segment %q was truncated to %d bytes after attach (%d mapped): its memory is gone",
			s.name, st.Size, len(s.data))
	}
	return allocated(s.name, &st)
}

func (s *shmMapping) Bytes(off, n int64, align int64) ([]byte, error) {
	return slice(s.data, s.name, off, n, align)
}

func (s *shmMapping) Close() error {
	if s.data == nil {
		return nil
	}
	err := syscall.Munmap(s.data)
	s.data = nil
	cerr := syscall.Close(s.fd)
	if err != nil {
		return fmt.Errorf("munmap %q: %w", s.name, err)
	}
	if cerr != nil {
		return fmt.Errorf("close %q: %w", s.name, cerr)
	}
	return nil
}

// slice is the shared-memory access: the one bounds check, then the bytes.
func slice(data []byte, name string, off, n, align int64) ([]byte, error) {
	if err := checkRange("segment", name, int64(len(data)), data == nil, off, n, align); err != nil {
		return nil, err
	}
	return data[off : off+n : off+n], nil
}

// checkRange is the one bounds check every access to client memory goes
// through, shared memory and CUDA allocations alike (kind names which).
func checkRange(kind, name string, size int64, closed bool, off, n, align int64) error {
	switch {
	case closed:
		return fmt.Errorf("%s %q is closed", kind, name)
	case off < 0 || n <= 0:
		return fmt.Errorf("%s %q: range [%d, +%d) invalid", kind, name, off, n)
	case off > size || n > size-off:
		return fmt.Errorf("%s %q: range [%d, %d) outside its %d bytes", kind, name, off, off+n, size)
	case align > 1 && off%align != 0:
		return fmt.Errorf("%s %q: offset %d not aligned to %d bytes", kind, name, off, align)
	}
	return nil
}
