package optimizer

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
)

// sliceReader reads a gradient from a slice, counting reads (the engine's
// workers call it at once); failAt >= 0 makes the read covering that byte
// fail.
type sliceReader struct {
	b      []byte
	failAt int
	reads  atomic.Int64
}

func (r *sliceReader) ReadGrad(dst []byte, off int) error {
	r.reads.Add(1)
	if r.failAt >= off && r.failAt < off+len(dst) {
		return errors.New("bad address")
	}
	copy(dst, r.b[off:off+len(dst)])
	return nil
}

func reader(b []byte) *sliceReader { return &sliceReader{b: b, failAt: -1} }

// readerCase is a float32 tensor of n elements to update: hyper-parameters,
// random parameters and a random gradient.
func readerCase(n int) (Hyper, []byte, []byte) {
	r := rand.New(rand.NewPCG(7, 8))
	return Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2},
		randBytes(r, Float32, n, 1, false), randBytes(r, Float32, n, 1e-2, false)
}

// TestApplyFromMatchesApply: an update whose gradient is read piece by piece
// equals the update from the whole gradient in memory, bit for bit, for
// every arithmetic (single-tensor, fused), both dtypes, amsgrad, sizes
// around the read pieces and the workers' chunks, and with accumulation.
func TestApplyFromMatchesApply(t *testing.T) {
	for _, d := range []DType{Float32, BFloat16} {
		piece := readPiece(d)
		if piece%64 != 0 {
			t.Fatalf("%v: pieces of %d elements, not whole 64-element blocks", d, piece)
		}
		sizes := []int{1, 7, 63, 65, piece - 1, piece, piece + 1, 3*piece + 17, 100003}
		for _, fused := range []bool{false, true} {
			for _, ams := range []bool{false, true} {
				h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: ams}
				for _, n := range sizes {
					for _, workers := range []int{1, 3} {
						name := fmt.Sprintf("%v/fused=%v/amsgrad=%v/n=%d/workers=%d", d, fused, ams, n, workers)
						r := rand.New(rand.NewPCG(uint64(n), 41))
						param := randBytes(r, d, n, 1, false)
						g1, g2, g3 := randBytes(r, d, n, 1e-2, false), randBytes(r, d, n, 1e-3, false), randBytes(r, d, n, 3e-2, false)
						e := &Engine{Workers: workers, MinChunk: 64}
						newT := func() *Tensor { return newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 42)), d, n, h, param) }
						sc := func(tt *Tensor) Scalars {
							s := ScalarsFor(h, tt.Step+1)
							s.Fused = fused
							return s
						}

						want, got := newT(), newT()
						for _, g := range [][]byte{g1, g2} { // two plain steps
							if err := e.Apply(want, g, sc(want)); err != nil {
								t.Fatal(err)
							}
							rd := reader(g)
							if err := e.ApplyFrom(got, rd, sc(got)); err != nil {
								t.Fatal(err)
							}
							if pieces := (n + piece - 1) / piece; rd.reads.Load() < int64(pieces) {
								t.Fatalf("%s: %d reads, want at least %d", name, rd.reads.Load(), pieces)
							}
						}
						// Then a step accumulated over three micro-batches.
						for _, g := range [][]byte{g1, g2} {
							if err := e.Accumulate(want, g); err != nil {
								t.Fatal(err)
							}
							if err := e.AccumulateFrom(got, reader(g)); err != nil {
								t.Fatal(err)
							}
						}
						if err := e.Apply(want, g3, sc(want)); err != nil {
							t.Fatal(err)
						}
						if err := e.ApplyFrom(got, reader(g3), sc(got)); err != nil {
							t.Fatal(err)
						}
						if diff := sameState(got, want); diff != "" {
							t.Fatalf("%s: read piece by piece differs in %s", name, diff)
						}
					}
				}
			}
		}
	}
}

// TestApplyFromReadFailure: a read that fails before anything was summed
// changes nothing; one that fails part way through an update marks the
// tensor damaged (it refuses updates until its state is imported).
func TestApplyFromReadFailure(t *testing.T) {
	piece := readPiece(Float32)
	n := 5*piece + 3
	h, param, g := readerCase(n)
	e := &Engine{Workers: 1, MinChunk: 64}
	bad := &sliceReader{b: g, failAt: 4 * piece * 4} // the fifth piece

	for _, tc := range []struct {
		name    string
		prepare func(*Tensor) error
		run     func(*Tensor) error
		damaged bool
	}{
		{"first accumulation", nil, func(tt *Tensor) error { return e.AccumulateFrom(tt, bad) }, false},
		{"apply", nil, func(tt *Tensor) error { return e.ApplyFrom(tt, bad, ScalarsFor(h, 6)) }, true},
		{"second accumulation", func(tt *Tensor) error { return e.Accumulate(tt, g) },
			func(tt *Tensor) error { return e.AccumulateFrom(tt, bad) }, true},
	} {
		tt := newTestTensor(t, rand.New(rand.NewPCG(7, 9)), Float32, n, h, param)
		if tc.prepare != nil {
			if err := tc.prepare(tt); err != nil {
				t.Fatal(err)
			}
		}
		before := snap(tt)
		err := tc.run(tt)
		if err == nil || !strings.Contains(err.Error(), "bad address") {
			t.Fatalf("%s: error %v, want the read's", tc.name, err)
		}
		if got := tt.Damage() != nil; got != tc.damaged {
			t.Fatalf("%s: damaged %v, want %v (%v)", tc.name, got, tc.damaged, err)
		}
		if !tc.damaged {
			if diff := before.diff(snap(tt)); diff != "" {
				t.Fatalf("%s: a failed first read changed %s", tc.name, diff)
			}
			continue
		}
		if err := e.Apply(tt, g, ScalarsFor(h, 6)); err == nil || !strings.Contains(err.Error(), "damaged") {
			t.Fatalf("%s: a damaged tensor took an update: %v", tc.name, err)
		}
	}
}

// TestApplyFromScaledMatchesApplyScaled: measuring and scaling the gradient
// piece by piece in the workers' buffers gives the update ApplyScaled gives
// (bit for bit) and the same squared norm (up to the order of the float64
// sum), without writing the source.
func TestApplyFromScaledMatchesApplyScaled(t *testing.T) {
	for _, d := range []DType{Float32, BFloat16} {
		for _, prep := range []GradPrep{{Scale: 0.37, Norm: true}, {Scale: 1, Norm: true}, {Scale: 2.5}} {
			piece := readPiece(d)
			for _, n := range []int{5, piece + 3, 4*piece + 100} {
				name := fmt.Sprintf("%v/%+v/n=%d", d, prep, n)
				h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
				r := rand.New(rand.NewPCG(uint64(n), 51))
				param := randBytes(r, d, n, 1, false)
				g := randBytes(r, d, n, 1e-1, false)
				e := &Engine{Workers: 3, MinChunk: 64}
				want := newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 52)), d, n, h, param)
				got := newTestTensor(t, rand.New(rand.NewPCG(uint64(n), 52)), d, n, h, param)
				wantSq, err := e.ApplyScaled(want, clone(g), ScalarsFor(h, 6), prep)
				if err != nil {
					t.Fatal(err)
				}
				src := clone(g)
				gotSq, err := e.ApplyFromScaled(got, reader(src), ScalarsFor(h, 6), prep)
				if err != nil {
					t.Fatal(err)
				}
				if diff := sameState(got, want); diff != "" {
					t.Fatalf("%s: differs in %s", name, diff)
				}
				if math.Abs(gotSq-wantSq) > 1e-12*math.Abs(wantSq) || (prep.Norm && gotSq == 0) {
					t.Fatalf("%s: squared norm %v, want %v", name, gotSq, wantSq)
				}
				if !bytes.Equal(src, g) {
					t.Fatalf("%s: the source gradient was written", name)
				}
			}
		}
	}
}

// TestPhases: an engine with Phases sums the time of the gradient reads (only
// on the reader path) and of the arithmetic (both paths); without Phases it
// times nothing and updates alike.
func TestPhases(t *testing.T) {
	n := 3*readPiece(Float32) + 5
	h, param, g := readerCase(n)
	for _, tc := range []struct {
		name       string
		fromReader bool
	}{{"in memory", false}, {"reader", true}} {
		t.Run(tc.name, func(t *testing.T) {
			var ph Phases
			timed := &Engine{Workers: 2, MinChunk: 64, Phases: &ph}
			plain := &Engine{Workers: 2, MinChunk: 64}
			a := newTestTensor(t, rand.New(rand.NewPCG(1, 2)), Float32, n, h, param)
			b := newTestTensor(t, rand.New(rand.NewPCG(1, 2)), Float32, n, h, param)
			for i, e := range []*Engine{timed, plain} {
				tt := []*Tensor{a, b}[i]
				var err error
				if tc.fromReader {
					err = e.ApplyFrom(tt, reader(g), ScalarsFor(h, 1))
				} else {
					err = e.Apply(tt, g, ScalarsFor(h, 1))
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(a.Param, b.Param) || !bytes.Equal(a.ExpAvgSq, b.ExpAvgSq) {
				t.Fatal("timing changed the update")
			}
			if ph.Kernel() <= 0 {
				t.Errorf("kernel time %v, want > 0", ph.Kernel())
			}
			if got := ph.Read() > 0; got != tc.fromReader {
				t.Errorf("read time %v, want > 0: %v", ph.Read(), tc.fromReader)
			}
		})
	}
}
