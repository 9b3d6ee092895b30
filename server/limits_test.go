package server

import (
	"fmt"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestSegmentLimits attaches segments from two clients under per-session and
// total bounds: an attach past either is refused with a clear error before
// anything is opened, and a detach makes room again.
func TestSegmentLimits(t *testing.T) {
	type attach struct {
		client  string
		detach  bool   // detach this client's oldest segment instead
		refused string // "" when it must succeed, else a part of the error
	}
	for _, tc := range []struct {
		name         string
		total, per   int
		steps        []attach
		wantSegments int
	}{
		{name: "no bound", steps: []attach{{client: "a"}, {client: "a"}, {client: "a"}}, wantSegments: 3},
		{name: "per session", total: 10, per: 2, steps: []attach{
			{client: "a"}, {client: "a"},
			{client: "a", refused: "too many segments attached: 2 by this session (limit 2 a session)"},
			{client: "b"}, {client: "b"},
		}, wantSegments: 4},
		{name: "total", total: 3, per: 2, steps: []attach{
			{client: "a"}, {client: "a"}, {client: "b"},
			{client: "b", refused: "too many segments attached: 3 by all sessions (limit 3)"},
		}, wantSegments: 3},
		{name: "detach makes room", total: 2, per: 2, steps: []attach{
			{client: "a"}, {client: "a"},
			{client: "a", refused: "limit 2 a session"},
			{client: "a", detach: true},
			{client: "a"},
		}, wantSegments: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.s.MaxSegments, h.s.MaxSessionSegments = tc.total, tc.per
			held := map[string][]*testSegment{}
			for i, st := range tc.steps {
				if st.detach {
					seg := held[st.client][0]
					held[st.client] = held[st.client][1:]
					h.must(st.client, ipc.OpDetach, ipc.Detach{Seg: seg.id})
					continue
				}
				seg := h.newSegment(fmt.Sprintf("sonar-lim-%d", i), 4096)
				rep, err := h.call(st.client, ipc.OpAttach, ipc.Attach{Shm: seg.name, Size: 4096})
				switch {
				case st.refused == "" && err != nil:
					t.Fatalf("step %d: attach refused: %v", i, err)
				case st.refused != "" && (err == nil || !strings.Contains(err.Error(), st.refused)):
					t.Fatalf("step %d: attach: %v, want an error with %q", i, err, st.refused)
				case err == nil:
					seg.id = rep.(ipc.AttachReply).Seg
					held[st.client] = append(held[st.client], seg)
				}
			}
			if got := h.s.Stats().Segments; got != tc.wantSegments {
				t.Fatalf("%d segments attached, want %d", got, tc.wantSegments)
			}
		})
	}
}

// TestErrorsClipClientValues sends requests whose strings are 4 MiB: the
// error reply quotes at most a clipped piece of each (with its full length),
// and hello logs a clipped client name.
func TestErrorsClipClientValues(t *testing.T) {
	big := strings.Repeat("A", 4<<20)
	for _, tc := range []struct {
		name  string
		op    string
		body  any
		local bool
		want  string // part of the error
	}{
		{name: "unknown op", op: big, want: "unknown op"},
		{name: "attach name", op: ipc.OpAttach, body: ipc.Attach{Shm: big, Size: 1}, want: "shared-memory name not allowed"},
		{name: "sqrt_lib over tcp", op: ipc.OpHello, body: ipc.Hello{SqrtLib: big}, want: "operator trusts"},
		{name: "sqrt_lib relative", op: ipc.OpHello, body: ipc.Hello{SqrtLib: big}, local: true, want: "absolute path"},
		{name: "sqrt_lib too long", op: ipc.OpHello, body: ipc.Hello{SqrtLib: "/" + big}, local: true, want: "longer than a path"},
		{name: "register dtype", op: ipc.OpRegister, body: ipc.Register{Tensors: []ipc.TensorSpec{{Name: "w", Shape: []int64{1}, DType: big,
			Param: ipc.MemRef{Seg: 1, Bytes: 4}, Hyper: ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}}}}, want: "unsupported dtype"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.s.LocalClients = tc.local
			h.s.LoadSqrt = func(string) (optimizer.Sqrt, string, error) { return optimizer.Sqrt{}, "", fmt.Errorf("not loaded") }
			_, err := h.call("c", tc.op, tc.body)
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			if !strings.Contains(msg, tc.want) || !strings.Contains(msg, "bytes)") {
				t.Errorf("error %.300q: want %q and a length note", msg, tc.want)
			}
			if len(msg) > 1024 {
				t.Errorf("error of %d bytes for a request of 4 MiB", len(msg))
			}
		})
	}
	t.Run("hello log", func(t *testing.T) {
		core, logs := observer.New(zap.InfoLevel)
		h := newHarness(t)
		h.s.log = zap.New(core)
		h.must("c", ipc.OpHello, ipc.Hello{Client: big, Torch: big, Capability: big})
		for _, e := range logs.All() {
			for _, f := range e.Context {
				if len(f.String) > 1024 {
					t.Errorf("log %q: field %s of %d bytes", e.Message, f.Key, len(f.String))
				}
			}
		}
		if logs.Len() == 0 {
			t.Error("hello logged nothing")
		}
	})
}
