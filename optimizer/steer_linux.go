//go:build linux

package optimizer

import (
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// currentCPU is the CPU the calling thread runs on (-1 when unknown).
func currentCPU() int {
	var cpu uint32
	if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); errno != 0 {
		return -1
	}
	return int(cpu)
}

// awayFrom wires the calling goroutine to its thread and takes cpu out of
// the thread's CPU mask; the returned function puts the mask back and
// unwires it. A mask without cpu, or with cpu alone, is left as it is.
func awayFrom(cpu int) (restore func()) {
	runtime.LockOSThread()
	var old unix.CPUSet
	if cpu < 0 || unix.SchedGetaffinity(0, &old) != nil || !old.IsSet(cpu) || old.Count() < 2 {
		return runtime.UnlockOSThread
	}
	away := old
	away.Clear(cpu)
	if unix.SchedSetaffinity(0, &away) != nil {
		return runtime.UnlockOSThread
	}
	return func() {
		// The thread's own mask as it was; should that fail (its cpuset
		// shrank meanwhile), the thread keeps the narrower mask: no update
		// depends on where it runs.
		_ = unix.SchedSetaffinity(0, &old)
		runtime.UnlockOSThread()
	}
}
