package optimizer

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// scaledCopy is the gradient a client would send after grad.mul_(s) in torch.
func scaledCopy(d DType, g []byte, s float32) []byte {
	out := clone(g)
	switch d {
	case Float32:
		for i, x := range F32s(out) {
			F32s(out)[i] = x * s
		}
	case BFloat16:
		for i, h := range U16s(out) {
			U16s(out)[i] = F32ToBF16(BF16ToF32(h) * s)
		}
	}
	return out
}

func sqNorm(d DType, g []byte) float64 {
	var sum float64
	switch d {
	case Float32:
		for _, x := range F32s(g) {
			sum += float64(x) * float64(x)
		}
	case BFloat16:
		for _, h := range U16s(g) {
			x := float64(BF16ToF32(h))
			sum += x * x
		}
	}
	return sum
}

// ApplyScaled with a factor equals Apply on the gradient scaled beforehand,
// and reports the squared norm of the unscaled gradient, for any split.
func TestApplyScaledEqualsApplyOnScaledGrad(t *testing.T) {
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	cases := []struct {
		d      DType
		n      int
		scale  float32
		accum  int // micro-batches accumulated before the one applied
		norm   bool
		wantSq bool
	}{
		{Float32, 1, 0.5, 0, true, true},
		{Float32, 1000, 0.123456, 0, true, true},
		{Float32, 100003, 0.0071, 1, true, true},
		{Float32, 4099, 1, 0, true, true}, // norm only
		{Float32, 4099, 0.3, 0, false, false},
		{BFloat16, 7, 0.37, 0, true, true},
		{BFloat16, 100003, 0.0071, 2, true, true},
		{BFloat16, 31, 0, 0, true, true}, // 0: no scaling
	}
	for _, tc := range cases {
		for _, workers := range []int{1, 3} {
			name := fmt.Sprintf("%v/n=%d/scale=%g/accum=%d/workers=%d", tc.d, tc.n, tc.scale, tc.accum, workers)
			r := rand.New(rand.NewPCG(uint64(tc.n), 5))
			param := randBytes(r, tc.d, tc.n, 1, false)
			grads := make([][]byte, tc.accum+1)
			for i := range grads {
				grads[i] = randBytes(r, tc.d, tc.n, 1e-2, false)
			}
			e := &Engine{Workers: workers, MinChunk: 64}
			ref := newTestTensor(t, rand.New(rand.NewPCG(uint64(tc.n), 6)), tc.d, tc.n, h, param)
			got := newTestTensor(t, rand.New(rand.NewPCG(uint64(tc.n), 6)), tc.d, tc.n, h, param)
			// The reference: accumulate, then scale the sum, then Apply.
			sum := clone(grads[0])
			for _, g := range grads[1:] {
				switch tc.d {
				case Float32:
					AddF32(F32s(sum), F32s(g))
				case BFloat16:
					AddBF16(U16s(sum), U16s(g))
				}
			}
			s := tc.scale
			if s == 0 {
				s = 1
			}
			if err := e.Apply(ref, scaledCopy(tc.d, sum, s), ScalarsFor(h, ref.Step+1)); err != nil {
				t.Fatal(err)
			}
			for _, g := range grads[:tc.accum] {
				if err := e.Accumulate(got, clone(g)); err != nil {
					t.Fatal(err)
				}
			}
			last := clone(grads[tc.accum])
			sq, err := e.ApplyScaled(got, last, ScalarsFor(h, got.Step+1), GradPrep{Scale: tc.scale, Norm: tc.norm})
			if err != nil {
				t.Fatal(err)
			}
			if diff := sameState(got, ref); diff != "" {
				t.Fatalf("%s: differs from Apply on the scaled gradient in %s", name, diff)
			}
			want := 0.0
			if tc.wantSq {
				want = sqNorm(tc.d, sum)
			}
			if math.Abs(sq-want) > 1e-12*math.Max(1, want) {
				t.Fatalf("%s: squared norm %v, want %v", name, sq, want)
			}
			if tc.accum == 0 && (tc.scale == 0 || tc.scale == 1) && !bytes.Equal(last, grads[0]) {
				t.Fatalf("%s: the gradient was written without a factor", name)
			}
		}
	}
}

// BenchmarkApplyScaled: the cost of measuring and scaling the gradient
// (expert clipping) against the plain update, 4M elements.
func BenchmarkApplyScaled(b *testing.B) {
	const n = 4 << 20
	h := Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	for _, d := range []DType{Float32, BFloat16} {
		for _, prep := range []GradPrep{{}, {Norm: true}, {Scale: 0.5, Norm: true}} {
			b.Run(fmt.Sprintf("%v/norm=%v/scale=%g", d, prep.Norm, prep.Scale), func(b *testing.B) {
				r := rand.New(rand.NewPCG(1, 2))
				tt, err := NewTensor("w", d, n, h, randBytes(r, d, n, 1, false))
				if err != nil {
					b.Fatal(err)
				}
				g := randBytes(r, d, n, 1e-3, false)
				e := NewEngine()
				b.SetBytes(int64(n * d.Size()))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if prep.Scale != 0 { // keep the gradient from shrinking to zero over iterations
						prep.Scale = 1 / prep.Scale
					}
					if _, err := e.ApplyScaled(tt, g, ScalarsFor(h, tt.Step+1), prep); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
