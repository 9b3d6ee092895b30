package server

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
)

// moreSpecs are n float32 tensors of 8 elements in the world's param segment
// after its three tensors, named prefix0, prefix1, ...
func (w *world) moreSpecs(prefix string, first, n int) []ipc.TensorSpec {
	specs := make([]ipc.TensorSpec, n)
	def := ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	for i := range specs {
		off := 4096 + 32*(first+i)
		specs[i] = ipc.TensorSpec{Name: fmt.Sprintf("%s%d", prefix, first+i), Shape: []int64{8}, DType: "float32",
			Param: ipc.MemRef{Seg: w.params.id, Offset: int64(off), Bytes: 32}, Hyper: def}
	}
	return specs
}

// registered says which of names the session has registered.
func (w *world) registered(specs []ipc.TensorSpec) []bool {
	ss := w.s.sessions[w.client]
	got := make([]bool, len(specs))
	for i, sp := range specs {
		_, got[i] = ss.names[sp.Name]
	}
	return got
}

// TestRegisterMore: a registration spread over several requests with More is
// all or none. The request without More registers the staged tensors and its
// own, ids staged first; an error in any request drops what was staged, so
// a retry of the same names succeeds; a segment that staged tensors use
// cannot be detached; the memory budget counts the staged tensors.
func TestRegisterMore(t *testing.T) {
	for _, tc := range []struct {
		name string
		// steps: each register request's specs (indices into 0..9 of
		// moreSpecs("x", ...)), More set on all but the last.
		chunks [][2]int // [first, count]
		// breakChunk spoils that request (-1: none) with a duplicate name
		// (dup), an unknown dtype (dtype) or a budget too small (budget).
		breakChunk int
		how        string
		wantErr    string
	}{
		{"three requests", [][2]int{{0, 3}, {3, 3}, {6, 4}}, -1, "", ""},
		{"one request without more", [][2]int{{0, 10}}, -1, "", ""},
		{"a staged request fails", [][2]int{{0, 3}, {3, 3}, {6, 4}}, 1, "dtype", "unsupported dtype"},
		{"the last request fails", [][2]int{{0, 3}, {3, 3}, {6, 4}}, 2, "dtype", "unsupported dtype"},
		{"a name staged twice", [][2]int{{0, 3}, {3, 3}, {6, 4}}, 1, "dup", "appears twice"},
		{"a name staged and repeated at the end", [][2]int{{0, 3}, {3, 3}, {6, 4}}, 2, "dup", "appears twice"},
		{"over the budget with the staged tensors", [][2]int{{0, 5}, {5, 5}}, 1, "budget", "over the memory budget"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			all := w.moreSpecs("x", 0, 10)
			var ids []uint32
			var err error
			for k, c := range tc.chunks {
				req := ipc.Register{Tensors: slices.Clone(all[c[0] : c[0]+c[1]]), More: k < len(tc.chunks)-1}
				if k == tc.breakChunk {
					switch tc.how {
					case "dtype":
						req.Tensors[0].DType = "float16"
					case "dup":
						req.Tensors[0].Name = all[0].Name
					case "budget":
						// The session holds the world's three tensors; room
						// for them and the first request's alone.
						held, _ := w.s.hostStateBytes(w.s.sessions[w.client])
						w.s.MaxSessionStateBytes = held + int64(c[1])*optimizer.StateBytesFor(optimizer.Float32, 8, false)
					}
				}
				var rep any
				rep, err = w.call(w.client, ipc.OpRegister, req)
				if err != nil {
					break
				}
				got := rep.(ipc.RegisterReply).IDs
				if req.More && len(got) != 0 {
					t.Fatalf("request %d with more: ids %v, want none", k, got)
				}
				ids = got
			}
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if len(ids) != len(all) {
					t.Fatalf("%d ids for %d tensors", len(ids), len(all))
				}
				ss := w.s.sessions[w.client]
				for i, id := range ids {
					if tn := ss.tensors[id]; tn == nil || tn.name != all[i].Name || tn.state == nil {
						t.Fatalf("id %d: tensor %+v, want %s with its state", id, tn, all[i].Name)
					}
				}
				if len(ss.staged) != 0 || len(ss.stagedNames) != 0 {
					t.Errorf("staging left behind: %d tensors", len(ss.staged))
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
			if tc.breakChunk > 0 && !strings.Contains(err.Error(), "staged by earlier register requests were dropped") {
				t.Errorf("error %v does not say the staged tensors were dropped", err)
			}
			if got := w.registered(all); slices.Contains(got, true) {
				t.Fatalf("registered after the error: %v", got)
			}
			// Nothing was kept: the same names register in one request.
			w.s.MaxSessionStateBytes = 0
			if rep := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: all}).(ipc.RegisterReply); len(rep.IDs) != len(all) {
				t.Fatalf("retry: %v", rep.IDs)
			}
		})
	}
}

// TestRegisterMoreDetachAndLimit: a segment holding staged tensors cannot be
// detached (a later register would point at memory gone), and a session
// stages at most ipc.MaxStaged tensors.
func TestRegisterMoreDetachAndLimit(t *testing.T) {
	w := newWorld(t)
	extra := w.newSegment("sonar-extra", 4096)
	w.attach(w.client, extra)
	spec := w.moreSpecs("y", 0, 1)
	spec[0].Param = ipc.MemRef{Seg: extra.id, Offset: 0, Bytes: 32}
	w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: spec, More: true})
	if _, err := w.call(w.client, ipc.OpDetach, ipc.Detach{Seg: extra.id}); err == nil || !strings.Contains(err.Error(), "staged") {
		t.Fatalf("detach with a staged tensor: %v", err)
	}
	if rep := w.must(w.client, ipc.OpRegister, ipc.Register{Tensors: w.moreSpecs("x", 0, 2)}).(ipc.RegisterReply); len(rep.IDs) != 3 {
		t.Fatalf("commit: %v", rep.IDs)
	}

	ss := w.s.sessions[w.client]
	ss.staged = make([]*tensor, ipc.MaxStaged-1)
	_, err := w.call(w.client, ipc.OpRegister, ipc.Register{Tensors: w.moreSpecs("z", 0, 2), More: true})
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("want at most %d", ipc.MaxStaged)) {
		t.Fatalf("past MaxStaged: %v", err)
	}
	if len(ss.staged) != 0 {
		t.Errorf("%d staged after the refusal", len(ss.staged))
	}
}
