package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// A private sonard (SonarAdamW's own, started with --parent-pid) must not
// outlive its trainer however the trainer ends: SIGTERM, SIGKILL, os._exit,
// a crash. Two mechanisms, either one enough:
//
//   - the parent-death signal (prctl PR_SET_PDEATHSIG): the kernel signals
//     sonard when its parent dies. It is tied to the parent *thread* that
//     started sonard, so the signal also comes when only that thread ends
//     (a trainer that built SonarAdamW in a worker thread): the signal is
//     therefore only a wake-up, and sonard stops only if the parent process
//     is gone. It is also tied to the thread of sonard that set it; the main
//     goroutine is locked to the main thread (init below), which never ends.
//   - a pidfd of the parent process (pidfd_open), polled; it also covers a
//     sonard started through a wrapper (its parent is then not the trainer,
//     and the death signal is not set).
func init() { runtime.LockOSThread() }

// parentDeathSignal wakes sonard when its parent thread ends.
const parentDeathSignal = unix.SIGUSR2

// watchParent returns a channel closed once process ppid has exited.
func watchParent(ppid int, log *zap.Logger) (<-chan struct{}, error) {
	if ppid <= 1 {
		return nil, fmt.Errorf("--parent-pid %d: want the pid of the process sonard belongs to", ppid)
	}
	gone := make(chan struct{})
	stop := func(why string) {
		select {
		case <-gone:
		default:
			log.Warn("the process this private sonard belongs to has exited: stopping", zap.Int("parent_pid", ppid), zap.String("seen_by", why))
			close(gone)
		}
	}
	wake := make(chan os.Signal, 1)
	if os.Getppid() == ppid {
		signal.Notify(wake, parentDeathSignal)
		if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(parentDeathSignal), 0, 0, 0); err != nil {
			return nil, fmt.Errorf("prctl PR_SET_PDEATHSIG: %w", err)
		}
	}
	alive, err := parentProbe(ppid)
	if err != nil {
		return nil, err
	}
	// The parent may have died before the death signal was set.
	if os.Getppid() != ppid && !alive() {
		stop("start")
		return gone, nil
	}
	go func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-wake:
				if !alive() {
					stop("parent-death signal")
					return
				}
				log.Info("parent thread ended, parent process lives on: still serving", zap.Int("parent_pid", ppid))
			case <-tick.C:
				if !alive() {
					stop("pidfd")
					return
				}
			}
		}
	}()
	return gone, nil
}

// parentProbe returns a function that reports whether ppid still runs: a
// pidfd when the kernel has them (immune to pid reuse), else kill(pid, 0).
func parentProbe(ppid int) (func() bool, error) {
	fd, err := unix.PidfdOpen(ppid, 0)
	switch {
	case err == nil:
		return func() bool {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(fds, 0)
			return err != nil || n == 0 || fds[0].Revents&unix.POLLIN == 0
		}, nil
	case errors.Is(err, unix.ESRCH):
		return func() bool { return false }, nil
	case errors.Is(err, unix.ENOSYS):
		return func() bool { return unix.Kill(ppid, 0) == nil || errors.Is(unix.Kill(ppid, 0), unix.EPERM) }, nil
	}
	return nil, fmt.Errorf("pidfd_open %d: %w", ppid, err)
}

// readToken reads the admin token file (mode 0600, at least 16 characters).
func readToken(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("admin token: %w", err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("admin token %s has mode %o: want 0600", path, st.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("admin token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return "", fmt.Errorf("admin token %s: want at least 16 characters", path)
	}
	return tok, nil
}

// removeRunDir removes a private server's run directory once its parent
// has exited (nobody is left to do it) or, with its token, asked the server to
// stop (a client cut short before its own removal): the files SonarAdamW puts there (the
// log, the owner token; the socket is removed with the transport), then the
// directory if that left it empty. Nothing else is ever removed.
func removeRunDir(dir string, log *zap.Logger) {
	for _, name := range []string{"sonard.log", "owner.token", "sonard.sock"} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			log.Warn("run directory", zap.Error(err))
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.Warn("run directory", zap.Error(err))
	}
}
