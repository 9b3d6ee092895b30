package server

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/sonar-moe/sonar/ipc"
	"golang.org/x/sys/unix"
)

// openSegment creates a fully allocated segment as a client does and keeps
// its file open, as a client can: after attach the server has unlinked the
// name, but the client can still truncate the memory through its fd.
func (h *harness) openSegment(name string, size int) (*testSegment, *os.File) {
	h.t.Helper()
	f, err := os.OpenFile(filepath.Join(h.dir, name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { f.Close() })
	if err := unix.Fallocate(int(f.Fd()), 0, 0, int64(size)); err != nil {
		h.t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = syscall.Munmap(mem) })
	return &testSegment{name: name, mem: mem}, f
}

// TestTruncatedSegmentIsRefused: a client truncates a segment it attached
// (the gradient's, then the parameter's) and steps. The server answers with
// an error naming the segment, changes nothing, and serves the other
// session, whose state stays intact.
func TestTruncatedSegmentIsRefused(t *testing.T) {
	for _, which := range []string{"grad", "param"} {
		t.Run(which, func(t *testing.T) {
			w := newWorld(t)
			w.applyAll()
			seg, f := w.openSegment("sonar-mine", segSize)
			w.attach(w.client, seg)
			grad := w.newGrad(0, 0)
			if which == "grad" { // the gradient comes from the truncated segment
				copy(seg.mem[grad.Offset:], w.grads.mem[grad.Offset:grad.Offset+grad.Bytes])
				grad.Seg = seg.id
			}
			// A second client, stepped once.
			other := w.newSegment("sonar-other", 4096)
			w.attach("c2", other)
			x := w.must("c2", ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "x", Shape: []int64{8}, DType: "float32",
				Param: ipc.MemRef{Seg: other.id, Offset: 0, Bytes: 32}, Hyper: hyperMsg(w.ts[0].hyper)}}}).(ipc.RegisterReply).IDs[0]
			xstep := func(step int64) ipc.Step {
				sc := w.item(0, grad, true).Scalars
				return ipc.Step{Items: []ipc.StepItem{{Tensor: x, Grad: ipc.MemRef{Seg: other.id, Offset: 1024, Bytes: 32}, Apply: true, Step: step, Scalars: sc}}}
			}
			w.must("c2", ipc.OpStep, xstep(1))

			if which == "param" {
				// Move tensor 0's parameter into the segment about to shrink:
				// a fresh tensor registered there.
				copy(seg.mem[8192:], w.param(0))
				spec := w.ts[0].spec(w.params)
				spec.Name, spec.Param = "in-mine", ipc.MemRef{Seg: seg.id, Offset: 8192, Bytes: int64(w.ts[0].nbytes())}
				id := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{spec}}).(ipc.RegisterReply).IDs[0]
				c := *w.ts[0]
				c.id, c.name = id, spec.Name
				w.ts = append(w.ts, &c)
			}
			before := w.snapshot()
			if err := f.Truncate(0); err != nil {
				t.Fatal(err)
			}
			item := w.item(len(w.ts)-1, grad, true)
			if which == "grad" {
				item = w.item(0, grad, true)
			}
			_, err := w.call(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{item}})
			if err == nil || !strings.Contains(err.Error(), "sonar-mine") || !strings.Contains(err.Error(), "truncated") {
				t.Fatalf("step over a truncated %s segment: %v", which, err)
			}
			if d := before.diff(w.snapshot()); d != "" {
				t.Fatalf("the refused step changed %s", d)
			}
			w.must("c2", ipc.OpStep, xstep(2)) // the server keeps serving
		})
	}
}

// TestOverlapThroughSecondName: a hard link gives one file two names; both
// attached, a gradient in the second at the parameter's bytes is the
// parameter itself and is refused, as in the first.
func TestOverlapThroughSecondName(t *testing.T) {
	w := newWorld(t)
	seg, _ := w.openSegment("sonar-a", segSize)
	if err := os.Link(filepath.Join(w.dir, "sonar-a"), filepath.Join(w.dir, "sonar-b")); err != nil {
		t.Fatal(err)
	}
	w.attach(w.client, seg)
	alias := &testSegment{name: "sonar-b", mem: seg.mem}
	w.attach(w.client, alias)
	spec := w.ts[0].spec(w.params)
	spec.Name, spec.Param = "linked", ipc.MemRef{Seg: seg.id, Offset: 0, Bytes: int64(w.ts[0].nbytes())}
	id := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{spec}}).(ipc.RegisterReply).IDs[0]
	for _, tc := range []struct {
		name string
		ref  ipc.MemRef
		ok   bool
	}{
		{"same bytes through the other name", ipc.MemRef{Seg: alias.id, Offset: 0, Bytes: spec.Param.Bytes}, false},
		{"partial overlap through the other name", ipc.MemRef{Seg: alias.id, Offset: 64, Bytes: spec.Param.Bytes}, false},
		{"same bytes, same name", ipc.MemRef{Seg: seg.id, Offset: 0, Bytes: spec.Param.Bytes}, false},
		{"disjoint bytes through the other name", ipc.MemRef{Seg: alias.id, Offset: 4096, Bytes: spec.Param.Bytes}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := w.item(0, tc.ref, true).Scalars
			_, err := w.call(w.client, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: id, Grad: tc.ref, Apply: false, Scalars: sc}}})
			if tc.ok != (err == nil) || (err != nil && !strings.Contains(err.Error(), "overlaps the parameter")) {
				t.Fatalf("got %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

// TestStateBudget: registers and accumulating steps beyond the session's or
// the server's budget are refused and change nothing.
func TestStateBudget(t *testing.T) {
	const n = 1024 // float32 elements: 4 KiB parameter, 8 KiB of state
	tests := []struct {
		name            string
		total, session  int64
		otherTensors    int  // registered first by a second client
		register        int  // tensors in one register request
		wantRegister    bool // succeeds
		wantAccumulate  bool // then a first micro-batch of one of them succeeds
		wantErrContains string
	}{
		{"fits", 64 << 10, 0, 0, 2, true, true, ""},
		{"session budget", 0, 16 << 10, 0, 3, false, false, "--max-session-state-bytes"},
		{"total budget across sessions", 24 << 10, 0, 2, 2, false, false, "--max-state-bytes"},
		{"exactly full, accumulation buffer over", 16 << 10, 0, 0, 2, true, false, "gradient accumulation"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.s.MaxStateBytes, h.s.MaxSessionStateBytes = tc.total, tc.session
			if tc.session == 0 {
				h.s.MaxSessionStateBytes = tc.total
			}
			spec := func(seg *testSegment, i int) ipc.TensorSpec {
				return ipc.TensorSpec{Name: "t" + string(rune('a'+i)), Shape: []int64{n}, DType: "float32",
					Param: ipc.MemRef{Seg: seg.id, Offset: int64(i * 4 * n), Bytes: 4 * n}, Hyper: ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999}}
			}
			if tc.otherTensors > 0 {
				o := h.newSegment("sonar-o", 8*4*n)
				h.attach("c2", o)
				var specs []ipc.TensorSpec
				for i := range tc.otherTensors {
					specs = append(specs, spec(o, i))
				}
				h.must("c2", ipc.OpRegister, ipc.Register{Tensors: specs})
			}
			seg := h.newSegment("sonar-p", 8*4*n)
			h.attach("c1", seg)
			before := h.s.Stats()
			var specs []ipc.TensorSpec
			for i := range tc.register {
				specs = append(specs, spec(seg, i))
			}
			rep, err := h.call("c1", ipc.OpRegister, ipc.Register{Tensors: specs})
			if (err == nil) != tc.wantRegister {
				t.Fatalf("register: %v, want success %v", err, tc.wantRegister)
			}
			if err != nil {
				if !strings.Contains(err.Error(), tc.wantErrContains) || !strings.Contains(err.Error(), "nothing was registered") {
					t.Errorf("error %q does not name %q", err, tc.wantErrContains)
				}
				if after := h.s.Stats(); after.Tensors != before.Tensors || after.StateBytes != before.StateBytes {
					t.Errorf("refused register changed the server: %+v -> %+v", before, after)
				}
				return
			}
			id := rep.(ipc.RegisterReply).IDs[0]
			grad := ipc.MemRef{Seg: seg.id, Offset: int64(7 * 4 * n), Bytes: 4 * n}
			_, err = h.call("c1", ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: id, Grad: grad}}})
			if (err == nil) != tc.wantAccumulate {
				t.Fatalf("accumulate: %v, want success %v", err, tc.wantAccumulate)
			}
			if err != nil && !strings.Contains(err.Error(), tc.wantErrContains) {
				t.Errorf("error %q does not name %q", err, tc.wantErrContains)
			}
		})
	}
}
