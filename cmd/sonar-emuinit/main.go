// Command sonar-emuinit is the PID 1 of the throwaway Linux guest that
// scripts/emu-avx512 boots inside the Bochs emulator (an AVX-512 capable CPU
// model on hosts that lack AVX-512). It owns the guest's whole user space:
// it mounts the few pseudo file systems a test binary may expect, runs
// /payload with the arguments stored in /payload.args and the environment
// additions in /payload.env (both NUL-separated) with
// its stdout and stderr on the console (the emulated serial port), reports
// the payload's exit status between fixed markers and powers the machine off.
//
// Output protocol on the console, one marker per line:
//
//	SONAR-EMU-CPU <flags>   the guest's /proc/cpuinfo flags (informational)
//	SONAR-EMU-START         the payload starts; its output follows
//	SONAR-EMU-EXIT <rc>     the payload ended with status rc (128+signal when
//	                        killed by a signal, 127 when it could not start);
//	                        it may follow the payload's unterminated last line
//
// It is not meant to run anywhere else: outside PID 1 it refuses to start.
package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	payloadPath = "/payload"
	argsPath    = "/payload.args"
	envPath     = "/payload.env"
)

func main() {
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "sonar-emuinit: must run as PID 1 inside the emulated guest")
		os.Exit(2)
	}
	rc := run()
	// No newline first: the harness takes a marker at the end of a line, so
	// a payload's last line needs no trailing newline and gains no blank one.
	fmt.Printf("SONAR-EMU-EXIT %d\n", rc)
	syscall.Sync()
	// Writes to the console return once the tty has queued them; the
	// emulated UART sends them at 115200 baud. Wait until it has sent all
	// (tcdrain), or powering off would cut the payload's last output.
	if err := unix.IoctlSetInt(1, unix.TCSBRK, 1); err != nil {
		time.Sleep(5 * time.Second)
	}
	time.Sleep(100 * time.Millisecond)
	if err := syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		fmt.Printf("sonar-emuinit: power off: %v\n", err)
	}
	// PID 1 must never exit (the kernel would panic); wait to be killed.
	for {
		time.Sleep(time.Hour)
	}
}

// run prepares the guest, runs the payload and returns its exit status.
func run() int {
	mountAll()
	// Only emergencies from the kernel may interleave with the payload output.
	// 8 = SYSLOG_ACTION_CONSOLE_LEVEL.
	syscall.Syscall(syscall.SYS_SYSLOG, 8, 0, 1)

	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		fmt.Printf("SONAR-EMU-CPU %s\n", cpuFlags(data))
	}

	args, err := readNULs(argsPath)
	var env []string
	if err == nil {
		env, err = readNULs(envPath)
	}
	if err != nil {
		fmt.Printf("sonar-emuinit: %v\n", err)
		fmt.Println("SONAR-EMU-START")
		return 127
	}

	cmd := exec.Command(payloadPath, args...)
	cmd.Dir = "/"
	cmd.Stdin = nil
	cmd.Stdout = os.Stdout
	cmd.Stderr = os.Stdout
	cmd.Env = append([]string{
		"PATH=/",
		"HOME=/",
		"TMPDIR=/tmp",
		"SONAR_EMU=1",
	}, env...)

	fmt.Println("SONAR-EMU-START")
	os.Stdout.Sync()
	err = cmd.Run()
	if err == nil {
		return 0
	}
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		if ws, ok := exitErr.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			fmt.Printf("sonar-emuinit: payload killed by signal %v\n", ws.Signal())
			return 128 + int(ws.Signal())
		}
		return exitErr.ExitCode()
	}
	fmt.Printf("sonar-emuinit: cannot run payload: %v\n", err)
	return 127
}

// mountAll mounts proc, sysfs, devtmpfs and a tmpfs on /tmp. Failures are
// reported but not fatal: most payloads need none of them.
func mountAll() {
	mounts := []struct {
		src, dir, fstype string
	}{
		{"proc", "/proc", "proc"},
		{"sysfs", "/sys", "sysfs"},
		{"devtmpfs", "/dev", "devtmpfs"},
		{"tmpfs", "/tmp", "tmpfs"},
	}
	for _, m := range mounts {
		if err := os.MkdirAll(m.dir, 0o755); err != nil {
			fmt.Printf("sonar-emuinit: mkdir %s: %v\n", m.dir, err)
			continue
		}
		if err := syscall.Mount(m.src, m.dir, m.fstype, 0, ""); err != nil {
			fmt.Printf("sonar-emuinit: mount %s: %v\n", m.dir, err)
		}
	}
}

// readNULs returns the NUL-separated strings of path (the payload's
// arguments or environment), or none when the file is absent.
func readNULs(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if len(data) == 0 {
		return nil, nil
	}
	// Every argument, the last included, ends with a NUL.
	data = bytes.TrimSuffix(data, []byte{0})
	return strings.Split(string(data), "\x00"), nil
}

// cpuFlags returns the flags line of the first processor in /proc/cpuinfo.
func cpuFlags(cpuinfo []byte) string {
	for _, line := range strings.Split(string(cpuinfo), "\n") {
		key, value, ok := strings.Cut(line, ":")
		if ok && strings.TrimSpace(key) == "flags" {
			return strings.TrimSpace(value)
		}
	}
	return "?"
}
