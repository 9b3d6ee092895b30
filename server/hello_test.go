package server

import (
	"errors"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
)

// Each session has its own float32 square root: the library the client
// names in hello, loaded (once per path) only for local clients.
func TestHelloSqrtPerSession(t *testing.T) {
	loads := map[string]int{}
	loader := func(path string) (optimizer.Sqrt, string, error) {
		if strings.Contains(path, "missing") {
			return optimizer.Sqrt{}, "", errors.New("vml: stat " + path + ": no such file or directory")
		}
		loads[path]++
		return optimizer.CallSqrt(func(dst, src []float32) {}), "mkl:" + path, nil
	}
	tests := []struct {
		name   string
		local  bool
		loader SqrtLoader
		lib    string
		want   string // the session's sqrt, or the error
		fails  bool
	}{
		{"IEEE client", true, loader, "", "ieee", false},
		{"library from a local client", true, loader, "/opt/torch/lib/libtorch_cpu.so", "mkl:/opt/torch/lib/libtorch_cpu.so", false},
		{"library from a tcp client", false, loader, "/opt/torch/lib/libtorch_cpu.so", "loads only the libraries its operator trusts", true},
		{"trusted library from a tcp client", false, loader, "/trusted/libtorch_cpu.so", "mkl:/trusted/libtorch_cpu.so", false},
		{"relative path", true, loader, "libtorch_cpu.so", "want an absolute path", true},
		{"library that does not load", true, loader, "/missing/libtorch_cpu.so", "no such file", true},
		{"server without a loader", true, nil, "/opt/torch/lib/libtorch_cpu.so", "cannot load", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.s.LocalClients, h.s.LoadSqrt = tc.local, tc.loader
			h.s.TrustedSqrtLibs = map[string]bool{"/trusted/libtorch_cpu.so": true}
			rep, err := h.call("c", ipc.OpHello, ipc.Hello{Client: "t", SqrtLib: tc.lib})
			if tc.fails {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("err = %v, want %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := rep.(ipc.HelloReply).Sqrt; got != tc.want {
				t.Errorf("sqrt %q, want %q", got, tc.want)
			}
		})
	}

	// Two clients of one server, two square roots; a later hello may not
	// change the square root of a session that attached memory.
	h := newHarness(t)
	h.s.LocalClients, h.s.LoadSqrt = true, loader
	a := h.must("a", ipc.OpHello, ipc.Hello{SqrtLib: "/x/libtorch_cpu.so"}).(ipc.HelloReply)
	b := h.must("b", ipc.OpHello, ipc.Hello{}).(ipc.HelloReply)
	if a.Sqrt != "mkl:/x/libtorch_cpu.so" || b.Sqrt != "ieee" {
		t.Errorf("sessions' sqrt: %q and %q", a.Sqrt, b.Sqrt)
	}
	h.attach("a", h.newSegment("sonar-a", 4096))
	if _, err := h.call("a", ipc.OpHello, ipc.Hello{}); err == nil || !strings.Contains(err.Error(), "changes the float32 sqrt") {
		t.Errorf("hello changing the sqrt after attach: %v", err)
	}
	h.must("a", ipc.OpHello, ipc.Hello{SqrtLib: "/x/libtorch_cpu.so"})
}
