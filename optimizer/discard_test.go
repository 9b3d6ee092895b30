package optimizer

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// TestTensorDiscard: Discard drops the pending micro-batches and changes
// nothing else, so the next step equals that of a tensor from the same start
// that never saw them, bit for bit; it clears a damage mark that concerns the
// accumulated sum alone and keeps one of an interrupted apply or import.
func TestTensorDiscard(t *testing.T) {
	const n = 1000
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: true}
	e := &Engine{Workers: 2, MinChunk: 64}
	for _, d := range []DType{Float32, BFloat16} {
		r := rand.New(rand.NewPCG(11, uint64(d)))
		param := randBytes(r, d, n, 1, false)
		g1, g2, fresh := randBytes(r, d, n, 1e-2, false), randBytes(r, d, n, 1e-2, false), randBytes(r, d, n, 1e-2, false)
		bad := &sliceReader{b: g2, failAt: 0}
		for _, tc := range []struct {
			name    string
			prepare func(*Tensor) error
			had     bool // Discard's answer
			usable  bool // the tensor steps afterwards (else it stays damaged)
		}{
			{"nothing pending", func(*Tensor) error { return nil }, false, true},
			{"one micro-batch", func(tt *Tensor) error { return e.Accumulate(tt, g1) }, true, true},
			{"two micro-batches", func(tt *Tensor) error {
				if err := e.Accumulate(tt, g1); err != nil {
					return err
				}
				return e.AccumulateFrom(tt, reader(g2))
			}, true, true},
			{"sum spoiled by a failed read", func(tt *Tensor) error {
				if err := e.Accumulate(tt, g1); err != nil {
					return err
				}
				if err := e.AccumulateFrom(tt, bad); err == nil || tt.Damage() == nil {
					t.Fatalf("the failed read did not damage the tensor: %v", err)
				}
				return nil
			}, true, true},
			{"sum spoiled by a memory fault", func(tt *Tensor) error {
				if err := e.Accumulate(tt, g1); err != nil {
					return err
				}
				tt.damage = &FaultError{Tensor: tt.Name, Op: "accumulate", Partial: true} // as faulted marks it
				tt.dropAccum()
				return nil
			}, true, true},
			{"apply interrupted by a failed read", func(tt *Tensor) error {
				if err := e.ApplyFrom(tt, bad, ScalarsFor(h, 6)); err == nil || tt.Damage() == nil {
					t.Fatalf("the failed read did not damage the tensor: %v", err)
				}
				return nil
			}, false, false},
			{"import interrupted by a memory fault", func(tt *Tensor) error {
				if err := e.Accumulate(tt, g1); err != nil {
					return err
				}
				tt.damage = &FaultError{Tensor: tt.Name, Op: "import", Partial: true}
				return nil
			}, true, false},
		} {
			name := d.String() + "/" + tc.name
			tt := newTestTensor(t, rand.New(rand.NewPCG(5, 6)), d, n, h, param)
			ref := newTestTensor(t, rand.New(rand.NewPCG(5, 6)), d, n, h, param)
			if err := tc.prepare(tt); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			before := snap(tt)
			if got := tt.Discard(); got != tc.had {
				t.Errorf("%s: Discard reported %v, want %v", name, got, tc.had)
			}
			if tt.Pending() != 0 || tt.accum != nil || tt.StateBytes() != 3*n*d.Size() {
				t.Errorf("%s: after Discard pending %d, buffer kept %v, state bytes %d", name, tt.Pending(), tt.accum != nil, tt.StateBytes())
			}
			after := snap(tt)
			before.accum, before.pending = nil, 0
			if diff := before.diff(after); diff != "" {
				t.Errorf("%s: Discard changed %s", name, diff)
			}
			if tt.Discard() {
				t.Errorf("%s: a second Discard found something pending", name)
			}
			err := e.Apply(tt, fresh, ScalarsFor(h, 6))
			if !tc.usable {
				if err == nil || !strings.Contains(err.Error(), "damaged") {
					t.Errorf("%s: a tensor damaged in its state stepped after Discard: %v", name, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if err := e.Apply(ref, fresh, ScalarsFor(h, 6)); err != nil {
				t.Fatal(err)
			}
			if diff := sameState(tt, ref); diff != "" {
				t.Errorf("%s: the step after Discard differs from one without the micro-batches: %s", name, diff)
			}
		}
	}
}
