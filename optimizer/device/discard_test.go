package device

import (
	"bytes"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda/cudatest"
	"github.com/sonar-moe/sonar/optimizer"
)

// TestEngineDiscard (stand-in driver): Discard drops the pending
// micro-batches and frees the accumulation buffer as an apply does; the
// next apply then launches AdamW on the fresh gradient itself, with the
// descriptor a tensor that never accumulated would get, and no add kernel.
// A buffer a failed Step left behind with nothing counted is freed too.
func TestEngineDiscard(t *testing.T) {
	e, f := fakeEngine(t)
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	param, _ := e.Dev.Alloc(16)
	grad, _ := e.Dev.Alloc(16)
	fresh, _ := e.Dev.Alloc(16)
	defer e.Dev.Free(param)
	defer e.Dev.Free(grad)
	defer e.Dev.Free(fresh)
	sc := optimizer.ScalarsFor(h, 1)

	for _, tc := range []struct {
		name       string
		microBatch int  // accumulated before the discard
		failCopy   bool // the first accumulation's copy fails (a buffer, nothing counted)
		had        bool
	}{
		{"nothing pending", 0, false, false},
		{"one micro-batch", 1, false, true},
		{"two micro-batches", 2, false, true},
		{"buffer of a failed step", 0, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tt, err := e.NewTensor("w", optimizer.Float32, 4, h, param)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Free(tt)
			base := f.State(cudatest.LiveAllocs)
			for range tc.microBatch {
				if err := e.Step(nil, []Item{{T: tt, Grad: grad}}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.failCopy {
				f.Fail("cuMemcpyDtoDAsync_v2", 1)
				if err := e.Step(nil, []Item{{T: tt, Grad: grad}}); err == nil {
					t.Fatal("the failing copy went through")
				}
			}
			if tc.microBatch > 0 || tc.failCopy {
				if f.State(cudatest.LiveAllocs) != base+1 || tt.Pending() != tc.microBatch {
					t.Fatalf("before the discard: %d buffers, pending %d", f.State(cudatest.LiveAllocs)-base, tt.Pending())
				}
			}
			f.ClearLog()
			if got := e.Discard(tt); got != tc.had {
				t.Errorf("Discard reported %v, want %v", got, tc.had)
			}
			if tt.Pending() != 0 || tt.Step != 0 || tt.StateBytes() != 32 {
				t.Errorf("after Discard: pending %d step %d state bytes %d", tt.Pending(), tt.Step, tt.StateBytes())
			}
			if got := f.State(cudatest.LiveAllocs); got != base {
				t.Errorf("after Discard: %d allocations more than before the micro-batches (the accumulation buffer must go)", got-base)
			}
			if e.Discard(tt) {
				t.Error("a second Discard found something pending")
			}
			if log := strings.TrimSpace(f.Log()); log != "" {
				t.Errorf("Discard queued stream work: %q", log)
			}

			if err := e.Step(nil, []Item{{T: tt, Grad: fresh, Apply: true, Scalars: sc}}); err != nil {
				t.Fatal(err)
			}
			if got := strings.TrimSpace(f.Kernels()); got != "sonar_adamw_f32" {
				t.Errorf("apply after Discard launched %q, want AdamW alone (no copy into, or add to, an old sum)", got)
			}
			want, _, err := PackBatch([]Launch{{Param: param, Grad: fresh, ExpAvg: tt.m, ExpAvgSq: tt.v, Numel: 4, Scalars: sc, Step: 1}})
			if err != nil {
				t.Fatal(err)
			}
			var dims [7]uint32
			var stream uintptr
			got := make([]byte, len(want))
			f.Launch(&dims, &stream, &got[0], int32(len(got)))
			if !bytes.Equal(got, want) {
				t.Error("the AdamW launch after Discard is not that of the fresh gradient alone")
			}
			if tt.Step != 1 || tt.Pending() != 0 {
				t.Errorf("after the apply: step %d pending %d", tt.Step, tt.Pending())
			}
		})
	}
}
