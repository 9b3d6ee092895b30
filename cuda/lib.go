package cuda

import (
	"fmt"
	"runtime"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// openLibrary dlopens the first of names that loads. All failing, it returns
// a *libError naming names[0] (wrapping sentinel); notFound is set when every
// attempt failed because the file does not exist, so that the message is the
// plain "no CUDA driver (libcuda.so.1 not found)".
func openLibrary(sentinel error, what string, names []string) (uintptr, string, error) {
	if len(names) == 0 {
		return 0, "", &libError{sentinel: sentinel, what: what, name: "(no candidates)", notFound: true}
	}
	var details []string
	notFound := true
	for _, n := range names {
		h, err := dlopen(n)
		if err == nil {
			return h, n, nil
		}
		msg := err.Error()
		details = append(details, msg)
		if !isNotFound(msg) {
			notFound = false
		}
	}
	return 0, "", &libError{sentinel: sentinel, what: what, name: names[0], notFound: notFound,
		detail: strings.Join(details, "; ")}
}

// dlopen loads a library on a locked OS thread: dlerror's message is
// per-thread, and purego reads it in a second call that could otherwise run
// on another thread and find no message.
func dlopen(name string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
}

// isNotFound reports whether a dlopen message says the file does not exist
// (as opposed to existing but failing to load).
func isNotFound(msg string) bool {
	return strings.Contains(msg, "No such file") || strings.Contains(msg, "cannot open shared object file") ||
		strings.Contains(msg, "not found")
}

// binder binds C functions of one library to Go function variables and
// remembers the first missing symbol.
type binder struct {
	lib     uintptr
	libName string
	err     error
}

// bind sets *fptr (a pointer to a func variable) to call symbol name.
func (b *binder) bind(fptr any, name string) {
	if b.err != nil {
		return
	}
	sym, err := dlsym(b.lib, name)
	if err != nil || sym == 0 {
		b.err = fmt.Errorf("cuda: %s has no symbol %s (driver too old?): %v", b.libName, name, err)
		return
	}
	purego.RegisterFunc(fptr, sym)
}

// optional binds name if present and reports whether it was.
func (b *binder) optional(fptr any, name string) bool {
	sym, err := dlsym(b.lib, name)
	if err != nil || sym == 0 {
		return false
	}
	purego.RegisterFunc(fptr, sym)
	return true
}

// dlsym looks a symbol up on a locked OS thread (see dlopen).
func dlsym(lib uintptr, name string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return purego.Dlsym(lib, name)
}

// goString copies a NUL-terminated C string (nil gives "").
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// cStrings holds NUL-terminated copies of ss and an array of pointers to
// them (a char**) in Go memory, which does not move; keep the value alive
// (runtime.KeepAlive) until the C call that reads it returned.
type cStrings struct {
	ptrs []*byte
}

func newCStrings(ss []string) *cStrings {
	c := &cStrings{ptrs: make([]*byte, len(ss)+1)}
	for i, s := range ss {
		b := make([]byte, len(s)+1)
		copy(b, s)
		c.ptrs[i] = &b[0]
	}
	return c
}

// array is the char** (nil for no strings).
func (c *cStrings) array() unsafe.Pointer {
	if len(c.ptrs) <= 1 {
		return nil
	}
	return unsafe.Pointer(&c.ptrs[0])
}
