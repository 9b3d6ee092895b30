// Package fdlimit chooses how many file descriptors (and memory mappings)
// sonard lets its clients' requests take, from the process's limits.
//
// Each attached shared-memory segment holds a descriptor and a mapping, each
// client connection a descriptor. When a process runs out of descriptors,
// libzmq's ipc:// listener aborts the whole process (an assertion on EMFILE
// in accept, libzmq 4.3), so the server must never let clients take them all:
// a reserve always stays free for connections being accepted, the log, the
// libraries a client names, /proc reads and libzmq's own descriptors.
//
// The Go runtime raises the soft RLIMIT_NOFILE to the hard one minus one at
// start (Go 1.19+, package syscall's init; TestGoRaisesNoFile checks it);
// Read sees the raised limit. A hard limit is the operator's to raise.
package fdlimit

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// Limits are the process's limits and the shares chosen from them.
type Limits struct {
	// NoFile and NoFileMax are RLIMIT_NOFILE's soft (in effect) and hard
	// limits; MapCount is vm.max_map_count (0: unknown).
	NoFile, NoFileMax uint64
	MapCount          int
	// Reserve is the descriptors no client request may take.
	Reserve int
	// Segments bounds the segments attached by all sessions together,
	// SessionSegments those of one session.
	Segments, SessionSegments int
	// Conns bounds the client connections open at once.
	Conns int
}

// Bounds on the reserve: a quarter of the limit, at least minReserve and at
// most maxReserve descriptors. maxNoFile caps an unlimited limit.
const (
	minReserve = 32
	maxReserve = 4096
	maxNoFile  = 1 << 20
	// maxConns bounds Conns whatever the limit: each connection also
	// costs memory (on unix://, a goroutine and a 64 KiB read buffer), and
	// a few thousand clients of one server are plenty.
	maxConns = 4096
)

// Choose divides the descriptors of a soft limit of noFile (and, when
// mapCount > 0, the process's memory mappings) between the server's reserve,
// attached segments and connections:
//   - Reserve: noFile/4, within [32, 4096];
//   - the rest is split in halves, one for connections (Conns, at most
//     4096), one for segments (Segments), which are also at most mapCount/2
//     (the other half of the mappings is left to Go's heap, thread stacks
//     and libraries);
//   - SessionSegments: a quarter of Segments (at least 1), so that one client
//     cannot take the segments of all.
func Choose(noFile uint64, mapCount int) Limits {
	l := Limits{NoFile: noFile, NoFileMax: noFile, MapCount: mapCount}
	n := int(min(noFile, maxNoFile))
	l.Reserve = min(max(n/4, minReserve), maxReserve)
	rest := max(n-l.Reserve, 2)
	l.Conns = rest / 2
	l.Segments = rest - l.Conns
	l.Conns = min(l.Conns, maxConns)
	if mapCount > 0 {
		l.Segments = max(min(l.Segments, mapCount/2), 1)
	}
	l.SessionSegments = max(l.Segments/4, 1)
	return l
}

// Read reads the process's limits and chooses from them.
func Read() (Limits, error) {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		return Limits{}, fmt.Errorf("getrlimit RLIMIT_NOFILE: %w", err)
	}
	l := Choose(r.Cur, mapCount())
	l.NoFileMax = r.Max
	return l, nil
}

// mapCount is vm.max_map_count, 0 when it cannot be read.
func mapCount() int {
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	if err != nil {
		return 0
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 {
		return 0
	}
	return n
}
