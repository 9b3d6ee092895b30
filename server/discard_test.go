package server

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda/cudatest"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
)

// accumulate sends micro-batch k (a fresh random gradient in slot k) of the
// given tensors as one step request and returns the gradients sent.
func (w *world) accumulate(tensors []int, k int) map[int][]byte {
	w.t.Helper()
	sent := map[int][]byte{}
	var items []ipc.StepItem
	for _, i := range tensors {
		ref := w.newGrad(i, k)
		sent[i] = w.gradBytes(ref)
		items = append(items, w.item(i, ref, false))
	}
	if rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: items}).(ipc.StepReply); rep.Accumulated != len(tensors) {
		w.t.Fatalf("accumulate reply %+v", rep)
	}
	return sent
}

// discardIDs is a discard request for tensors (indices into w.ts).
func (w *world) discardIDs(tensors ...int) ipc.Discard {
	d := ipc.Discard{}
	for _, i := range tensors {
		d.Tensors = append(d.Tensors, w.ts[i].id)
	}
	return d
}

// TestDiscard: micro-batches accumulated, then discarded, are lost as torch's
// zero_grad loses .grad: the next step equals, bit for bit, the engine's step
// on a mirror from the same start that was given only the micro-batches sent
// after the discard; the parameter, state and step count are untouched by
// the discard, tensors not named keep their pending sums, and the reply
// counts the tensors that had something pending.
func TestDiscard(t *testing.T) {
	all := []int{0, 1, 2}
	for _, tc := range []struct {
		name      string
		abandoned int   // micro-batches of every tensor before the discard
		discard   []int // tensors discarded (the others keep their micro-batches)
		fresh     int   // micro-batches of every tensor after the discard
		lastGrad  bool  // the apply carries a gradient (else it applies the sum alone)
		want      int   // the reply's discarded
	}{
		{"one micro-batch, then one and an apply with a gradient", 1, all, 1, true, 3},
		{"two micro-batches, then one applied alone", 2, all, 1, false, 3},
		{"two micro-batches, then an apply of a gradient alone", 2, all, 0, true, 3},
		{"nothing pending", 0, all, 2, false, 0},
		{"some tensors", 2, []int{0, 2}, 1, true, 2},
		{"one tensor of several", 1, []int{1}, 0, true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			w.applyAll()                  // nonzero state
			counted := map[int][][]byte{} // what each tensor's step must sum
			for k := range tc.abandoned {
				for i, g := range w.accumulate(all, 1+k%2) {
					if !slices.Contains(tc.discard, i) {
						counted[i] = append(counted[i], g)
					}
				}
			}
			before := w.snapshot()
			rep := w.must(w.client, ipc.OpDiscard, w.discardIDs(tc.discard...)).(ipc.DiscardReply)
			if rep.Discarded != tc.want {
				t.Errorf("discarded %d, want %d", rep.Discarded, tc.want)
			}
			for i, ts := range w.ts {
				st, pending := w.server(i), 0
				if !slices.Contains(tc.discard, i) {
					pending = tc.abandoned
				}
				if st.Pending() != pending || st.Step != ts.mirror.Step {
					t.Errorf("%s: pending %d step %d after the discard, want %d and %d", ts.name, st.Pending(), st.Step, pending, ts.mirror.Step)
				}
				if pending == 0 && st.StateBytes() != ts.mirror.StateBytes() {
					t.Errorf("%s: %d state bytes after the discard, want %d (the accumulation buffer freed)", ts.name, st.StateBytes(), ts.mirror.StateBytes())
				}
			}
			w.checkMirrors() // parameters and state untouched
			if after := w.snapshot(); !bytes.Equal(before.segs[0], after.segs[0]) {
				t.Error("the discard wrote a parameter")
			}
			if again := w.must(w.client, ipc.OpDiscard, w.discardIDs(tc.discard...)).(ipc.DiscardReply); again.Discarded != 0 {
				t.Errorf("a second discard dropped %d", again.Discarded)
			}

			for k := range tc.fresh {
				for i, g := range w.accumulate(all, 1+k%2) {
					counted[i] = append(counted[i], g)
				}
			}
			var items []ipc.StepItem
			for i := range w.ts {
				ref := ipc.MemRef{}
				if tc.lastGrad {
					ref = w.newGrad(i, 3)
					counted[i] = append(counted[i], w.gradBytes(ref))
				}
				items = append(items, w.item(i, ref, true))
			}
			if rep := w.must(w.client, ipc.OpStep, ipc.Step{Items: items}).(ipc.StepReply); rep.Applied != len(w.ts) {
				t.Fatalf("apply reply %+v", rep)
			}
			// The mirror: the engine, given only what counts, in order.
			for i, ts := range w.ts {
				gs := counted[i]
				for _, g := range gs[:len(gs)-1] {
					if err := w.mirrorEngine.Accumulate(ts.mirror, g); err != nil {
						t.Fatal(err)
					}
				}
				if err := w.mirrorEngine.Apply(ts.mirror, gs[len(gs)-1], optimizer.ScalarsFor(ts.hyper, ts.mirror.Step+1)); err != nil {
					t.Fatal(err)
				}
			}
			w.checkMirrors()
		})
	}
}

// TestDiscardRefusalsChangeNothing: a discard naming an unknown tensor (or
// another session's), a tensor twice, or none is refused as a whole before
// anything is dropped: the pending sums of the tensors it names stay, and the
// step that follows applies them.
func TestDiscardRefusalsChangeNothing(t *testing.T) {
	w := newWorld(t)
	w.applyAll()
	pending := []map[int][]byte{w.accumulate([]int{0, 1, 2}, 1), w.accumulate([]int{0, 1, 2}, 2)}
	other := w.newSegment("sonar-other", 4096)
	w.attach("c2", other)
	theirs := w.must("c2", ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "x", Shape: []int64{8}, DType: "float32",
		Param: ipc.MemRef{Seg: other.id, Bytes: 32}, Hyper: hyperMsg(w.ts[0].hyper)}}}).(ipc.RegisterReply).IDs[0]
	ids := w.discardIDs(0, 1, 2).Tensors
	tooMany := make([]uint32, ipc.MaxItems+1)
	for i := range tooMany {
		tooMany[i] = uint32(1000 + i)
	}
	for _, tc := range []struct {
		name   string
		client string
		body   any
		want   string
	}{
		{"unknown tensor", "c1", ipc.Discard{Tensors: []uint32{999}}, "tensors[0]: unknown tensor 999"},
		{"known tensors, then an unknown one", "c1", ipc.Discard{Tensors: []uint32{ids[0], ids[1], 999}}, "tensors[2]: unknown tensor 999"},
		{"another session's tensor", "c1", ipc.Discard{Tensors: []uint32{ids[0], theirs}}, fmt.Sprintf("unknown tensor %d", theirs)},
		{"this session's tensor from another session", "c2", ipc.Discard{Tensors: []uint32{ids[1]}}, "unknown tensor"},
		{"duplicate", "c1", ipc.Discard{Tensors: []uint32{ids[0], ids[1], ids[0]}}, fmt.Sprintf("tensors[2]: tensor %d appears twice", ids[0])},
		{"empty list", "c1", ipc.Discard{Tensors: []uint32{}}, "0 tensors (want 1..4096)"},
		{"no list", "c1", map[string]any{}, "0 tensors (want 1..4096)"},
		{"too many", "c1", ipc.Discard{Tensors: tooMany}, "4097 tensors (want 1..4096)"},
		{"missing body", "c1", nil, "missing body"},
		{"malformed body", "c1", rawBody{0xc1}, "malformed body"},
		{"tensor id out of range", "c1", map[string]any{"tensors": []int64{1 << 32}}, "out of range for u32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := w.snapshot()
			_, err := w.call(tc.client, ipc.OpDiscard, tc.body)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), fmt.Sprintf("discard (request %d): ", w.id)) {
				t.Errorf("error %q does not name the op and request", err)
			}
			if diff := before.diff(w.snapshot()); diff != "" {
				t.Errorf("refused discard changed %s", diff)
			}
		})
	}
	// The micro-batches are all still there: applying the sum alone equals
	// the engine given both.
	var items []ipc.StepItem
	for i, ts := range w.ts {
		if err := w.mirrorEngine.Accumulate(ts.mirror, pending[0][i]); err != nil {
			t.Fatal(err)
		}
		if err := w.mirrorEngine.Apply(ts.mirror, pending[1][i], optimizer.ScalarsFor(ts.hyper, ts.mirror.Step+1)); err != nil {
			t.Fatal(err)
		}
		items = append(items, w.item(i, ipc.MemRef{}, true))
	}
	w.must(w.client, ipc.OpStep, ipc.Step{Items: items})
	w.checkMirrors()
	if st := w.s.Stats(); st.ByOp[ipc.OpDiscard] == 0 {
		t.Errorf("discards not counted by op: %v", st.ByOp)
	}
}

// failingReader is a gradient in a client's memory whose read fails (the
// client unmapped it during the request).
type failingReader struct{}

func (failingReader) ReadGrad([]byte, int) error { return errors.New("bad address") }

// TestDiscardDamagedTensor: a tensor whose accumulation was interrupted
// (the fault spoiled the pending sum, dropped then, and nothing else) refuses
// steps until a discard, which counts it and clears the mark: the next step
// equals the engine's without the lost micro-batches. One whose apply was
// interrupted (parameter and state may be partly updated) stays damaged: a
// discard is accepted and drops nothing, and only an import clears the mark.
func TestDiscardDamagedTensor(t *testing.T) {
	for _, tc := range []struct {
		name     string
		damage   func(w *world, st *optimizer.Tensor) error
		want     int  // discarded
		repaired bool // steps after the discard
	}{
		{"accumulation interrupted", func(w *world, st *optimizer.Tensor) error {
			w.accumulate([]int{0}, 1)
			return w.mirrorEngine.AccumulateFrom(st, failingReader{}) // as the CPU backend's read of a client's memory
		}, 1, true},
		{"apply interrupted", func(w *world, st *optimizer.Tensor) error {
			return w.mirrorEngine.ApplyFrom(st, failingReader{}, optimizer.ScalarsFor(w.ts[0].hyper, st.Step+1))
		}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			w.applyAll()
			st := w.server(0)
			if err := tc.damage(w, st); err == nil || st.Damage() == nil || st.Pending() != 0 {
				t.Fatalf("damage: err %v, damaged %v, pending %d", err, st.Damage(), st.Pending())
			}
			fresh := w.newGrad(0, 2)
			apply := ipc.Step{Items: []ipc.StepItem{w.item(0, fresh, true)}}
			if _, err := w.call(w.client, ipc.OpStep, apply); err == nil || !strings.Contains(err.Error(), "damaged") {
				t.Fatalf("a damaged tensor stepped: %v", err)
			}
			rep := w.must(w.client, ipc.OpDiscard, w.discardIDs(0, 1)).(ipc.DiscardReply)
			if rep.Discarded != tc.want {
				t.Errorf("discarded %d, want %d", rep.Discarded, tc.want)
			}
			if (st.Damage() == nil) != tc.repaired {
				t.Fatalf("damage after the discard: %v", st.Damage())
			}
			if !tc.repaired {
				if _, err := w.call(w.client, ipc.OpStep, apply); err == nil || !strings.Contains(err.Error(), "damaged") {
					t.Fatalf("a tensor damaged in its state stepped after a discard: %v", err)
				}
				// An import replaces the state and clears the mark.
				nb := int64(w.ts[0].nbytes())
				x := ipc.StateXfer{Tensor: w.ts[0].id, Step: st.Step, ExpAvg: ipc.MemRef{Seg: w.state.id, Bytes: nb},
					ExpAvgSq: ipc.MemRef{Seg: w.state.id, Offset: 1024, Bytes: nb}}
				w.must(w.client, ipc.OpImport, x)
				if st.Damage() != nil {
					t.Fatal("import did not clear the damage")
				}
				return
			}
			w.must(w.client, ipc.OpStep, apply)
			ts := w.ts[0]
			if err := w.mirrorEngine.Apply(ts.mirror, w.gradBytes(fresh), optimizer.ScalarsFor(ts.hyper, ts.mirror.Step+1)); err != nil {
				t.Fatal(err)
			}
			w.checkMirrors()
		})
	}
}

// TestDiscardOnCUDAStandIn: on the CUDA path (stand-in driver) a discard
// frees the accumulation buffer, leaves the state and step, and the next
// apply launches AdamW on the fresh gradient itself (no add kernel); a
// request may name CPU and CUDA tensors together.
func TestDiscardOnCUDAStandIn(t *testing.T) {
	w := newCUDAWorld(t)
	const c = "client"
	if hello := w.must(c, ipc.OpHello, ipc.Hello{Client: "test"}).(ipc.HelloReply); !slices.Contains(hello.Features, ipc.FeatureDiscard) {
		t.Errorf("hello features %v do not name %q", hello.Features, ipc.FeatureDiscard)
	}
	pSeg, gSeg := w.attachCUDA(c, w.params), w.attachCUDA(c, w.grads)
	hyper := ipc.HyperMsg{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	reg := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{
		{Name: "w1", Shape: []int64{256}, DType: "float32", Param: ipc.MemRef{Seg: pSeg, Offset: 0, Bytes: 1024}, Hyper: hyper},
		{Name: "w2", Shape: []int64{101}, DType: "bfloat16", Param: ipc.MemRef{Seg: pSeg, Offset: 1024, Bytes: 202}, Hyper: hyper},
	}}).(ipc.RegisterReply)
	shm := w.newSegment("sonar-cpu", 4096)
	w.attach(c, shm)
	cpuID := w.must(c, ipc.OpRegister, ipc.Register{Tensors: []ipc.TensorSpec{{Name: "cpu", Shape: []int64{8}, DType: "float32",
		Param: ipc.MemRef{Seg: shm.id, Bytes: 32}, Hyper: hyper}}}).(ipc.RegisterReply).IDs[0]
	state := w.s.Stats().DeviceStateBytes
	allocs := w.f.State(cudatest.LiveAllocs)

	old := ipc.MemRef{Seg: gSeg, Offset: 0, Bytes: 1024}
	for range 2 {
		w.must(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: reg.IDs[0], Grad: old}}})
	}
	w.must(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: cpuID, Grad: ipc.MemRef{Seg: shm.id, Offset: 1024, Bytes: 32}}}})
	if w.f.State(cudatest.LiveAllocs) != allocs+1 || w.s.Stats().DeviceStateBytes != state+1024 {
		t.Fatalf("accumulation: %d buffers, %d device state bytes", w.f.State(cudatest.LiveAllocs)-allocs, w.s.Stats().DeviceStateBytes)
	}
	before := w.read(w.params, 0, 1226)
	w.f.ClearLog()
	rep := w.must(c, ipc.OpDiscard, ipc.Discard{Tensors: []uint32{reg.IDs[0], reg.IDs[1], cpuID}}).(ipc.DiscardReply)
	if rep.Discarded != 2 {
		t.Errorf("discarded %d, want 2 (w1 and the CPU tensor)", rep.Discarded)
	}
	if got := w.f.State(cudatest.LiveAllocs); got != allocs || w.s.Stats().DeviceStateBytes != state {
		t.Errorf("after the discard: %d buffers, %d device state bytes (want %d)", got-allocs, w.s.Stats().DeviceStateBytes, state)
	}
	if log := strings.TrimSpace(w.f.Log()); log != "" {
		t.Errorf("the discard queued %q", log)
	}
	if got := w.read(w.params, 0, 1226); !bytes.Equal(got, before) {
		t.Error("the discard wrote a parameter")
	}
	for _, id := range []uint32{reg.IDs[0], cpuID} {
		if p := w.s.sessions[c].tensors[id].state.Pending(); p != 0 {
			t.Errorf("tensor %d: %d micro-batches still pending", id, p)
		}
	}

	sc := ipc.ScalarsMsg{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.1, Beta2: 0.999, OneMinusB2: 0.001, NegStepSize: -1e-3, BC2Sqrt: 0.0316, Eps: 1e-8}
	fresh := ipc.MemRef{Seg: gSeg, Offset: 4096, Bytes: 1024}
	w.f.ClearLog()
	w.must(c, ipc.OpStep, ipc.Step{Items: []ipc.StepItem{{Tensor: reg.IDs[0], Grad: fresh, Apply: true, Step: 1, Scalars: sc}}})
	if got := strings.TrimSpace(w.f.Kernels()); got != "sonar_adamw_f32" {
		t.Errorf("the apply after the discard launched %q, want AdamW alone", got)
	}
	desc := make([]byte, 16)
	var dims [7]uint32
	var stream uintptr
	w.f.Launch(&dims, &stream, &desc[0], int32(len(desc)))
	if p, g := binary.LittleEndian.Uint64(desc[0:]), binary.LittleEndian.Uint64(desc[8:]); p != uint64(w.params) || g != uint64(w.grads)+4096 {
		t.Errorf("AdamW descriptor: param %#x grad %#x, want the client's %#x and its fresh gradient %#x", p, g, uint64(w.params), uint64(w.grads)+4096)
	}
}
