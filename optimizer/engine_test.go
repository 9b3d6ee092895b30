package optimizer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
)

// randBytes returns n elements of random data of dtype d: params ~N(0,1),
// or with sq set non-negative values as exp_avg_sq holds.
func randBytes(r *rand.Rand, d DType, n int, scale float64, sq bool) []byte {
	var x []float32
	if sq {
		x = randSq32(r, n, scale)
	} else {
		x = randNormal32(r, n, scale)
	}
	b := make([]byte, n*d.Size())
	switch d {
	case Float32:
		copy(F32s(b), x)
	case BFloat16:
		copy(U16s(b), toBF16(x))
	}
	return b
}

// newTestTensor makes a tensor over a copy of param with a random state
// imported at step 5.
func newTestTensor(t *testing.T, r *rand.Rand, d DType, n int, h Hyper, param []byte) *Tensor {
	t.Helper()
	tt, err := NewTensor("w", d, n, h, clone(param))
	if err != nil {
		t.Fatal(err)
	}
	var maxSq []byte
	if h.Amsgrad {
		maxSq = randBytes(r, d, n, 1e-2, true)
	}
	if err := tt.ImportState(5, randBytes(r, d, n, 1e-2, false), randBytes(r, d, n, 1e-2, true), maxSq); err != nil {
		t.Fatal(err)
	}
	return tt
}

type snapshot struct {
	param, m, v, vmax, accum []byte
	step                     int64
	pending                  int
}

func snap(t *Tensor) snapshot {
	return snapshot{clone(t.Param), clone(t.ExpAvg), clone(t.ExpAvgSq), clone(t.MaxExpAvgSq), clone(t.accum), t.Step, t.accumCount}
}

func (a snapshot) diff(b snapshot) string {
	var d []string
	for _, c := range []struct {
		name string
		x, y []byte
	}{{"param", a.param, b.param}, {"exp_avg", a.m, b.m}, {"exp_avg_sq", a.v, b.v}, {"max_exp_avg_sq", a.vmax, b.vmax}, {"accum", a.accum, b.accum}} {
		if !bytes.Equal(c.x, c.y) {
			d = append(d, c.name)
		}
	}
	if a.step != b.step {
		d = append(d, fmt.Sprintf("step %d -> %d", a.step, b.step))
	}
	if a.pending != b.pending {
		d = append(d, fmt.Sprintf("pending %d -> %d", a.pending, b.pending))
	}
	return strings.Join(d, ", ")
}

func sameState(a, b *Tensor) string { return snap(a).diff(snap(b)) }

func TestEngineApplyIndependentOfSplit(t *testing.T) {
	sizes := []int{1, 7, 31, 1000, 100003}
	for _, d := range []DType{Float32, BFloat16} {
		for _, ams := range []bool{false, true} {
			h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: ams}
			for _, n := range sizes {
				name := fmt.Sprintf("%v/amsgrad=%v/n=%d", d, ams, n)
				r := rand.New(rand.NewPCG(uint64(n), 21))
				param := randBytes(r, d, n, 1, false)
				grads := [][]byte{randBytes(r, d, n, 1e-2, false), randBytes(r, d, n, 1e-2, false)}

				// The kernel called directly on whole arrays.
				ref := newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 22)), d, n, h, param)
				for i, g := range grads {
					s := ScalarsFor(h, ref.Step+1)
					var vmax []byte
					if ams {
						vmax = ref.MaxExpAvgSq
					}
					switch d {
					case Float32:
						StepF32(F32s(ref.Param), F32s(g), F32s(ref.ExpAvg), F32s(ref.ExpAvgSq), F32s(vmax), s, Sqrt{})
					case BFloat16:
						StepBF16(U16s(ref.Param), U16s(g), U16s(ref.ExpAvg), U16s(ref.ExpAvgSq), U16s(vmax), s)
					}
					ref.Step++
					if i == 0 && bytes.Equal(ref.Param, param) {
						t.Fatalf("%s: a step did not change the parameter", name)
					}
				}

				for _, workers := range []int{1, 2, 3, 8} {
					for _, minChunk := range []int{1, 64, 1000, 1 << 16} {
						if n < 1000 && minChunk > 64 {
							continue // the same single chunk as minChunk 64
						}
						e := &Engine{Workers: workers, MinChunk: minChunk}
						tt := newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 22)), d, n, h, param)
						for _, g := range grads {
							if err := e.Apply(tt, g, ScalarsFor(h, tt.Step+1)); err != nil {
								t.Fatal(err)
							}
						}
						if diff := sameState(tt, ref); diff != "" {
							t.Fatalf("%s workers=%d minChunk=%d: differs from the direct kernel in %s", name, workers, minChunk, diff)
						}
					}
				}
			}
		}
	}
}

func TestEngineUsesSqrt(t *testing.T) {
	const n = 5000
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}
	r := rand.New(rand.NewPCG(1, 23))
	param, g := randBytes(r, Float32, n, 1, false), randBytes(r, Float32, n, 1e-2, false)
	low := func(dst, src []float32) {
		for i, x := range src {
			dst[i] = Sqrt32(x) * (1 - 0x1p-20)
		}
	}
	var results [][]byte
	for _, e := range []*Engine{{Workers: 1, Sqrt: CallSqrt(low)}, {Workers: 3, MinChunk: 64, Sqrt: CallSqrt(low)}, {Workers: 1}} {
		tt := newTestTensor(t, rand.New(rand.NewPCG(1, 24)), Float32, n, h, param)
		if err := e.Apply(tt, g, ScalarsFor(h, tt.Step+1)); err != nil {
			t.Fatal(err)
		}
		results = append(results, tt.Param)
	}
	if !bytes.Equal(results[0], results[1]) {
		t.Error("custom sqrt: result depends on the split")
	}
	if bytes.Equal(results[0], results[2]) {
		t.Error("Engine.Sqrt is not used")
	}
}

// sumInDType adds grads left to right in the dtype, as autograd accumulates.
func sumInDType(d DType, grads ...[]byte) []byte {
	sum := clone(grads[0])
	for _, g := range grads[1:] {
		switch d {
		case Float32:
			s, x := F32s(sum), F32s(g)
			for i := range s {
				s[i] = float32(s[i] + x[i])
			}
		case BFloat16:
			s, x := U16s(sum), U16s(g)
			for i := range s {
				s[i] = F32ToBF16(float32(BF16ToF32(s[i]) + BF16ToF32(x[i])))
			}
		}
	}
	return sum
}

func TestEngineAccumulateThenApply(t *testing.T) {
	for _, d := range []DType{Float32, BFloat16} {
		for _, n := range []int{7, 1000, 100003} {
			name := fmt.Sprintf("%v/n=%d", d, n)
			h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: n == 1000}
			r := rand.New(rand.NewPCG(uint64(n), 25))
			param := randBytes(r, d, n, 1, false)
			// Grads of different scales, so the sum's rounding matters.
			g1, g2, g3 := randBytes(r, d, n, 1, false), randBytes(r, d, n, 1e-3, false), randBytes(r, d, n, 3e-2, false)
			e := &Engine{Workers: 3, MinChunk: 64}
			nb := n * d.Size()
			stateBytes := 2 * nb
			if h.Amsgrad {
				stateBytes = 3 * nb
			}
			newT := func() *Tensor { return newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 26)), d, n, h, param) }

			want := newT()
			if err := e.Apply(want, sumInDType(d, g1, g2, g3), ScalarsFor(h, 6)); err != nil {
				t.Fatal(err)
			}
			if want.StateBytes() != stateBytes || want.Pending() != 0 {
				t.Errorf("%s: plain apply keeps %d state bytes, pending %d", name, want.StateBytes(), want.Pending())
			}

			// Two accumulated, the third given to Apply. The caller reuses
			// its gradient memory at once: the engine must have copied it.
			a := newT()
			for i, g := range [][]byte{g1, g2} {
				buf := clone(g)
				if err := e.Accumulate(a, buf); err != nil {
					t.Fatal(err)
				}
				copy(buf, g3)
				if a.Pending() != i+1 {
					t.Fatalf("%s: pending %d after %d accumulations", name, a.Pending(), i+1)
				}
			}
			if a.StateBytes() != stateBytes+nb {
				t.Errorf("%s: %d state bytes while accumulating, want %d", name, a.StateBytes(), stateBytes+nb)
			}
			if !bytes.Equal(a.Param, param) || a.Step != 5 {
				t.Fatalf("%s: accumulation changed the parameter or step", name)
			}
			if err := e.Apply(a, g3, ScalarsFor(h, 6)); err != nil {
				t.Fatal(err)
			}
			if diff := sameState(a, want); diff != "" {
				t.Errorf("%s: accumulate x2 + apply(g3) differs from apply(sum) in %s", name, diff)
			}
			if a.StateBytes() != stateBytes || a.Pending() != 0 {
				t.Errorf("%s: after apply %d state bytes, pending %d", name, a.StateBytes(), a.Pending())
			}

			// Three accumulated, then Apply(nil).
			b := newT()
			for _, g := range [][]byte{g1, g2, g3} {
				if err := e.Accumulate(b, g); err != nil {
					t.Fatal(err)
				}
			}
			if err := e.Apply(b, nil, ScalarsFor(h, 6)); err != nil {
				t.Fatal(err)
			}
			if diff := sameState(b, want); diff != "" {
				t.Errorf("%s: accumulate x3 + apply(nil) differs from apply(sum) in %s", name, diff)
			}
			// The summation order is that of autograd: g1+g2 first.
			if d == BFloat16 && n == 100003 && bytes.Equal(sumInDType(d, g1, g2, g3), sumInDType(d, g3, g2, g1)) {
				t.Errorf("%s: data cannot tell summation orders apart", name)
			}
		}
	}
}

func TestEngineErrorsChangeNothing(t *testing.T) {
	const n = 1000
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	ha := h
	ha.Amsgrad = true
	e := &Engine{Workers: 2, MinChunk: 64}
	cases := []struct {
		name    string
		h       Hyper
		pending int // accumulations before the bad call
		call    func(tt *Tensor, g []byte) error
		wantErr string
	}{
		{"apply: short grad", h, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, g[:len(g)-4], ScalarsFor(h, 6)) }, "gradient is"},
		{"apply: long grad", h, 1, func(tt *Tensor, g []byte) error {
			return e.Apply(tt, append(clone(g), 0, 0, 0, 0), ScalarsFor(h, 6))
		}, "gradient is"},
		{"apply: empty grad", h, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, []byte{}, ScalarsFor(h, 6)) }, "gradient is"},
		{"accumulate: short grad", h, 0, func(tt *Tensor, g []byte) error { return e.Accumulate(tt, g[:len(g)-1]) }, "gradient is"},
		{"accumulate: short grad while pending", h, 2, func(tt *Tensor, g []byte) error { return e.Accumulate(tt, g[4:]) }, "gradient is"},
		{"apply: amsgrad in step, not registered", h, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, g, ScalarsFor(ha, 6)) }, "amsgrad"},
		{"apply: amsgrad registered, not in step", ha, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, g, ScalarsFor(h, 6)) }, "amsgrad"},
		{"apply: amsgrad mismatch while pending", h, 1, func(tt *Tensor, g []byte) error { return e.Apply(tt, g, ScalarsFor(ha, 6)) }, "amsgrad"},
		{"apply: amsgrad mismatch, nil grad, pending", ha, 2, func(tt *Tensor, g []byte) error { return e.Apply(tt, nil, ScalarsFor(h, 6)) }, "amsgrad"},
		{"apply: nothing accumulated", h, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, nil, ScalarsFor(h, 6)) }, "no gradient"},
		{"apply: nothing accumulated, amsgrad", ha, 0, func(tt *Tensor, g []byte) error { return e.Apply(tt, nil, ScalarsFor(ha, 6)) }, "no gradient"},
	}
	for _, d := range []DType{Float32, BFloat16} {
		for _, tc := range cases {
			name := fmt.Sprintf("%v/%s", d, tc.name)
			r := rand.New(rand.NewPCG(1, 27))
			param := randBytes(r, d, n, 1, false)
			g := randBytes(r, d, n, 1e-2, false)
			tt := newTestTensor(t, r, d, n, tc.h, param)
			for range tc.pending {
				if err := e.Accumulate(tt, randBytes(r, d, n, 1e-2, false)); err != nil {
					t.Fatal(err)
				}
			}
			before := snap(tt)
			err := tc.call(tt, g)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %v, want one mentioning %q", name, err, tc.wantErr)
				continue
			}
			if diff := before.diff(snap(tt)); diff != "" {
				t.Errorf("%s: failed call changed %s", name, diff)
			}
			// The tensor still works: pending gradients are still there.
			if tc.pending > 0 {
				if err := e.Apply(tt, nil, ScalarsFor(tc.h, 6)); err != nil {
					t.Errorf("%s: apply after the error: %v", name, err)
				}
			}
		}
	}
}

func TestImportState(t *testing.T) {
	const n = 33
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}
	ha := h
	ha.Amsgrad = true
	for _, d := range []DType{Float32, BFloat16} {
		nb := n * d.Size()
		r := rand.New(rand.NewPCG(2, 28))
		m, v, vmax := randBytes(r, d, n, 1, false), randBytes(r, d, n, 1, true), randBytes(r, d, n, 1, true)
		cases := []struct {
			name          string
			h             Hyper
			step          int64
			m, v, vmax    []byte
			wantErr       string
			wantStateVmax bool
		}{
			{"ok", h, 7, m, v, nil, "", false},
			{"ok, max_exp_avg_sq ignored without amsgrad", h, 7, m, v, vmax, "", false},
			{"ok, amsgrad", ha, 1 << 40, m, v, vmax, "", true},
			{"ok, step 0", h, 0, m, v, nil, "", false},
			{"negative step", h, -1, m, v, nil, "negative step", false},
			{"short exp_avg", h, 7, m[:nb-1], v, nil, "state is", false},
			{"long exp_avg_sq", h, 7, m, append(clone(v), 1, 2), nil, "state is", false},
			{"missing exp_avg", h, 7, nil, v, nil, "state is", false},
			{"amsgrad without max_exp_avg_sq", ha, 7, m, v, nil, "max_exp_avg_sq", false},
			{"amsgrad, short max_exp_avg_sq", ha, 7, m, v, vmax[:nb-2], "max_exp_avg_sq", false},
		}
		for _, tc := range cases {
			name := fmt.Sprintf("%v/%s", d, tc.name)
			tt := newTestTensor(t, r, d, n, tc.h, randBytes(r, d, n, 1, false))
			before := snap(tt)
			err := tt.ImportState(tc.step, tc.m, tc.v, tc.vmax)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Errorf("%s: error %v, want one mentioning %q", name, err, tc.wantErr)
				}
				if diff := before.diff(snap(tt)); diff != "" {
					t.Errorf("%s: failed import changed %s", name, diff)
				}
				continue
			}
			if err != nil {
				t.Errorf("%s: %v", name, err)
				continue
			}
			if tt.Step != tc.step || !bytes.Equal(tt.ExpAvg, tc.m) || !bytes.Equal(tt.ExpAvgSq, tc.v) {
				t.Errorf("%s: state not imported", name)
			}
			if tc.wantStateVmax != (tt.MaxExpAvgSq != nil) || (tc.wantStateVmax && !bytes.Equal(tt.MaxExpAvgSq, tc.vmax)) {
				t.Errorf("%s: max_exp_avg_sq not imported as expected", name)
			}
			// Copied, not aliased.
			if len(tt.ExpAvg) > 0 && &tt.ExpAvg[0] == &tc.m[0] {
				t.Errorf("%s: exp_avg aliases the source", name)
			}
			if !bytes.Equal(tt.Param, before.param) {
				t.Errorf("%s: import changed the parameter", name)
			}
		}
	}
}

func TestNewTensor(t *testing.T) {
	h := Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}
	bad := h
	bad.LR = -1
	cases := []struct {
		name    string
		d       DType
		numel   int
		h       Hyper
		param   []byte
		wantErr string
	}{
		{"float32", Float32, 10, h, make([]byte, 40), ""},
		{"bfloat16 amsgrad", BFloat16, 10, Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Amsgrad: true}, make([]byte, 20), ""},
		{"invalid hyper", Float32, 10, bad, make([]byte, 40), "learning rate"},
		{"zero numel", Float32, 0, h, nil, "must be positive"},
		{"negative numel", Float32, -4, h, nil, "must be positive"},
		{"param too short", Float32, 10, h, make([]byte, 39), "param memory"},
		{"param sized for bfloat16", Float32, 10, h, make([]byte, 20), "param memory"},
	}
	for _, tc := range cases {
		tt, err := NewTensor(tc.name, tc.d, tc.numel, tc.h, tc.param)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %v, want one mentioning %q", tc.name, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		nb := tc.numel * tc.d.Size()
		if tt.Bytes() != nb || len(tt.ExpAvg) != nb || len(tt.ExpAvgSq) != nb || tt.Step != 0 || tt.Pending() != 0 {
			t.Errorf("%s: bad sizes or counters: %+v", tc.name, tt)
		}
		if tc.h.Amsgrad != (len(tt.MaxExpAvgSq) == nb) {
			t.Errorf("%s: max_exp_avg_sq is %d bytes with amsgrad=%v", tc.name, len(tt.MaxExpAvgSq), tc.h.Amsgrad)
		}
		if &tt.Param[0] != &tc.param[0] {
			t.Errorf("%s: param is not the caller's memory", tc.name)
		}
		for _, b := range [][]byte{tt.ExpAvg, tt.ExpAvgSq, tt.MaxExpAvgSq} {
			if bytes.Count(b, []byte{0}) != len(b) {
				t.Errorf("%s: state not zeroed", tc.name)
			}
		}
		want := addrMod4K(tc.param)
		for i, b := range [][]byte{tt.ExpAvg, tt.ExpAvgSq, tt.MaxExpAvgSq} {
			if len(b) > 0 && addrMod4K(b) != want {
				t.Errorf("%s: state buffer %d at %d mod 4096, want the parameter's %d", tc.name, i, addrMod4K(b), want)
			}
		}
	}
}

func addrMod4K(b []byte) int { return int(uintptr(unsafe.Pointer(&b[0])) % 4096) }

func TestStaggered(t *testing.T) {
	offs := []int{0, 4, 512, 1024, 1536, 2560, 3584, 4092}
	for _, n := range []int{1, 4, 100, 4096, 5000, 1 << 20} {
		for _, off := range offs {
			for range 3 { // several allocations land at several base offsets
				b := staggered(n, off)
				if len(b) != n || cap(b) != n {
					t.Fatalf("staggered(%d, %d): len %d cap %d", n, off, len(b), cap(b))
				}
				if got := addrMod4K(b); got != off {
					t.Fatalf("staggered(%d, %d) starts at %d mod 4096", n, off, got)
				}
				if bytes.Count(b, []byte{0}) != n {
					t.Fatalf("staggered(%d, %d) not zeroed", n, off)
				}
			}
		}
	}
	// The state and the accumulation buffer start at the parameter's offset
	// (stateOffset), wherever that is; mapped buffers (from MapThreshold) too.
	r := rand.New(rand.NewPCG(3, 29))
	for _, n := range []int{3000, MapThreshold/4 + 5} {
		for _, off := range []int{0, 64, 512, 4032} {
			param := staggered(4*n, off)
			copy(param, randBytes(r, Float32, n, 1, false))
			tt, err := NewTensor("w", Float32, n, Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Amsgrad: true}, param)
			if err != nil {
				t.Fatal(err)
			}
			if err := (&Engine{Workers: 1}).Accumulate(tt, randBytes(r, Float32, n, 1, false)); err != nil {
				t.Fatal(err)
			}
			for i, b := range [][]byte{tt.ExpAvg, tt.ExpAvgSq, tt.MaxExpAvgSq, tt.accum} {
				if got := addrMod4K(b); got != off {
					t.Errorf("n=%d param at %d: buffer %d at %d mod 4096", n, off, i, got)
				}
			}
		}
	}
}

// TestParallelStalledWorker: while one worker is stuck in its first chunk
// (its core taken by another thread), the other workers take every other
// chunk; with one fixed chunk per worker the rest of its share would wait.
func TestParallelStalledWorker(t *testing.T) {
	const n = 1 << 20
	e := &Engine{Workers: 2, MinChunk: 1}
	var mu sync.Mutex
	done := 0
	rest := make(chan struct{})
	finished := make(chan error, 1)
	go func() {
		finished <- e.parallel(n, func(lo, hi int) {
			if lo == 0 {
				select { // stuck until every other chunk is done
				case <-rest:
				case <-time.After(10 * time.Second):
				}
			}
			mu.Lock()
			done += hi - lo
			if _, chunk := e.split(n); done == n-chunk {
				close(rest)
			}
			mu.Unlock()
		})
	}()
	select {
	case err := <-finished:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the other worker did not take the stalled worker's share")
	}
	if done != n {
		t.Fatalf("%d of %d elements done", done, n)
	}
}

func TestSplit(t *testing.T) {
	for _, tc := range []struct {
		name              string
		e                 *Engine
		n, workers, chunk int
	}{
		{"default: eight chunks per worker", &Engine{Workers: 2, MinChunk: 1 << 16}, 1 << 20, 2, 1 << 16},
		{"one fixed chunk per worker", &Engine{Workers: 2, MinChunk: 1 << 16, ChunksPerWorker: 1}, 1 << 20, 2, 1 << 19},
		{"chunks no shorter than minDynamicChunk", &Engine{Workers: 2, MinChunk: 1}, 100000, 2, minDynamicChunk},
		{"aligned to 64", &Engine{Workers: 3, MinChunk: 1, ChunksPerWorker: 1}, 100003, 3, 33344},
		{"below MinChunk: one worker", &Engine{Workers: 2, MinChunk: 1 << 16}, 1000, 1, 1000},
	} {
		w, c := tc.e.split(tc.n)
		if w != tc.workers || c != tc.chunk {
			t.Errorf("%s: split(%d) = %d workers, chunks of %d; want %d, %d", tc.name, tc.n, w, c, tc.workers, tc.chunk)
		}
	}
}

// TestParallelBoundsFixed: the chunks depend on n and the workers only.
func TestParallelBoundsFixed(t *testing.T) {
	for _, n := range []int{65, 100003, 1 << 20, 3<<20 + 17} {
		e := &Engine{Workers: 2, MinChunk: 1 << 16}
		var want [][2]int
		for run := range 3 {
			var mu sync.Mutex
			var got [][2]int
			if err := e.parallel(n, func(lo, hi int) {
				mu.Lock()
				got = append(got, [2]int{lo, hi})
				mu.Unlock()
			}); err != nil {
				t.Fatal(err)
			}
			slices.SortFunc(got, func(a, b [2]int) int { return a[0] - b[0] })
			if run == 0 {
				want = got
			} else if !slices.Equal(got, want) {
				t.Fatalf("n=%d: chunks %v, then %v", n, want, got)
			}
		}
	}
}

func TestParallelCoversOnce(t *testing.T) {
	for _, n := range []int{1, 7, 63, 64, 65, 1000, 100003} {
		for _, w := range []int{0, 1, 2, 3, 8, 64} {
			for _, mc := range []int{0, 1, 64, 1 << 16} {
				e := &Engine{Workers: w, MinChunk: mc, CallerWaits: n%2 == 1}
				hits := make([]int32, n)
				chunks := make(chan [2]int, 128)
				e.parallel(n, func(lo, hi int) {
					for i := lo; i < hi; i++ {
						hits[i]++ // chunks are disjoint: no race
					}
					chunks <- [2]int{lo, hi}
				})
				close(chunks)
				count := 0
				for c := range chunks {
					count++
					if c[0]%64 != 0 || c[0] >= c[1] {
						t.Fatalf("n=%d w=%d mc=%d: chunk [%d, %d)", n, w, mc, c[0], c[1])
					}
				}
				if count > max(w, 1)*chunksPerWorker {
					t.Fatalf("n=%d w=%d mc=%d: %d chunks", n, w, mc, count)
				}
				for i, h := range hits {
					if h != 1 {
						t.Fatalf("n=%d w=%d mc=%d: element %d visited %d times", n, w, mc, i, h)
					}
				}
			}
		}
	}
}

// TestParallelReturnsWhenChunksDone: parallel returns once every chunk is
// done, and a worker goroutine that starts after that calls fn no more (the
// caller may have taken every chunk itself: on one P it runs before them).
func TestParallelReturnsWhenChunksDone(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for _, w := range []int{2, 8} {
		e := &Engine{Workers: w, MinChunk: 1}
		var calls, elems atomic.Int64
		if err := e.parallel(100003, func(lo, hi int) {
			calls.Add(1)
			elems.Add(int64(hi - lo))
		}); err != nil {
			t.Fatal(err)
		}
		atReturn := calls.Load()
		if elems.Load() != 100003 {
			t.Fatalf("workers=%d: %d of 100003 elements done at return", w, elems.Load())
		}
		time.Sleep(20 * time.Millisecond) // the late goroutines run now
		if got := calls.Load(); got != atReturn {
			t.Fatalf("workers=%d: %d calls of fn after parallel returned", w, got-atReturn)
		}
	}
}

func TestDType(t *testing.T) {
	cases := []struct {
		in   string
		want DType
		size int
		name string
	}{
		{"float32", Float32, 4, "float32"},
		{"torch.float32", Float32, 4, "float32"},
		{"bfloat16", BFloat16, 2, "bfloat16"},
		{"torch.bfloat16", BFloat16, 2, "bfloat16"},
		{"float16", 0, 0, ""},
		{"torch.float64", 0, 0, ""},
		{"", 0, 0, ""},
		{"Float32", 0, 0, ""},
	}
	for _, tc := range cases {
		d, err := ParseDType(tc.in)
		if tc.want == 0 {
			if err == nil {
				t.Errorf("ParseDType(%q) = %v, want an error", tc.in, d)
			}
			continue
		}
		if err != nil || d != tc.want || d.Size() != tc.size || d.String() != tc.name {
			t.Errorf("ParseDType(%q) = %v (size %d), %v", tc.in, d, d.Size(), err)
		}
	}
	if s := DType(9).String(); s != "dtype(9)" {
		t.Errorf("DType(9).String() = %q", s)
	}
}
