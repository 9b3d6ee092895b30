// Package fault turns a memory fault (SIGBUS or SIGSEGV on a mapped address:
// a client truncated or punched a hole in a shared-memory segment it handed
// the server) into an error for the code that touched the memory, instead of
// the Go runtime's fatal "unexpected fault address". Every goroutine that
// reads or writes client memory runs that access through Catch.
package fault

import (
	"fmt"
	"runtime/debug"
)

// Error is a memory fault at Addr caught by Catch.
type Error struct {
	Addr uintptr
}

func (e *Error) Error() string {
	// The runtime's own text ("invalid memory address or nil pointer
	// dereference") misleads here: the address was mapped, its page is gone.
	return fmt.Sprintf("memory fault (SIGBUS/SIGSEGV) at address %#x: mapped memory whose pages are gone", e.Addr)
}

// Catch runs f with faults on memory turned into panics (debug.SetPanicOnFault,
// which is per goroutine) and returns a fault in f as an *Error. Any other
// panic is not a fault of client memory and propagates.
func Catch(f func()) (err error) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		// The runtime's fault panics carry the faulting address; nil-pointer
		// dereferences (addresses below 4 KiB) do not and are bugs.
		if fe, ok := r.(interface {
			error
			Addr() uintptr
		}); ok {
			err = &Error{Addr: fe.Addr()}
			return
		}
		panic(r)
	}()
	f()
	return nil
}
