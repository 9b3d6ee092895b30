package ipc

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"golang.org/x/sys/unix"
)

// signals waits, in Go's own poller, until one of a set of ZeroMQ sockets
// may have something to receive. libzmq signals each socket's state
// changes on a descriptor (ZMQ_FD); signals puts those descriptors in an
// epoll set of its own, whose descriptor Go's netpoller watches like a
// network connection's, so the waiting goroutine is parked by the runtime
// and no thread blocks in a call.
//
// Why not zmq_poll: a goroutine blocked in a cgo call keeps its P in the
// syscall state, and while any P is not idle the runtime's monitor thread
// (sysmon) wakes every 20 us (here every 90 us: timer slack), backing off
// only after about 50 wake-ups and retaking the P only after 10 ms. sonard
// waited in zmq_poll between requests, so after every request sysmon woke
// about 60 times on the cores the trainer's threads were computing on
// (perf sched, GraniteMoe training, 2026-12-02). Parked in the netpoller,
// every P is idle and sysmon sleeps.
//
// ZMQ_FD is edge-like: it tells that a socket's state may have changed, and
// any operation on the socket may consume the signal. So a caller asks the
// sockets (pending) before it waits and after every operation, and wait may
// return when nothing came.
type signals struct {
	socks []*zmq.Socket
	ep    *os.File // the epoll set, non-blocking, in Go's poller
	conn  syscall.RawConn
}

// watch makes a signals for socks. It fails where a descriptor cannot be
// watched (the caller then waits in zmq_poll).
func watch(socks ...*zmq.Socket) (*signals, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll: %w", err)
	}
	for _, s := range socks {
		fd, err := s.GetFd()
		if err != nil {
			unix.Close(epfd)
			return nil, fmt.Errorf("zmq fd: %w", err)
		}
		// Level-triggered: the set stays readable while a signal is unread.
		// The set holds the descriptor's file, not its number: a socket
		// closed first leaves the set by itself.
		if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			unix.Close(epfd)
			return nil, fmt.Errorf("epoll add zmq fd %d: %w", fd, err)
		}
	}
	// Non-blocking before NewFile, which then hands it to Go's poller.
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("epoll: %w", err)
	}
	ep := os.NewFile(uintptr(epfd), "zmq-signals")
	conn, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return nil, fmt.Errorf("epoll: %w", err)
	}
	// A file Go's poller does not watch has no deadlines: find out now.
	if err := ep.SetReadDeadline(time.Time{}); err != nil {
		ep.Close()
		return nil, fmt.Errorf("epoll set not pollable: %w", err)
	}
	return &signals{socks: socks, ep: ep, conn: conn}, nil
}

// pending says which sockets have a message to receive now (ZMQ_EVENTS).
func (s *signals) pending() []bool {
	out := make([]bool, len(s.socks))
	for i, sock := range s.socks {
		ev, err := sock.GetEvents()
		out[i] = err == nil && ev&zmq.POLLIN != 0
	}
	return out
}

// wait returns once the set is readable (a signal came, or one was unread),
// or after d.
func (s *signals) wait(d time.Duration) error {
	if err := s.ep.SetReadDeadline(time.Now().Add(d)); err != nil {
		return err
	}
	armed := false
	err := s.conn.Read(func(uintptr) bool {
		// The first call only arms the wait: the set's readiness is what
		// is waited for, nothing is read from it.
		done := armed
		armed = true
		return done
	})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	return err
}

// close stops watching (the sockets stay open).
func (s *signals) close() { s.ep.Close() }
