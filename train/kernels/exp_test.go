package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// ulps is the distance between a and b in float32 steps.
func ulps(a, b float32) int64 {
	ia, ib := int64(math.Float32bits(a)), int64(math.Float32bits(b))
	d := ia - ib
	if d < 0 {
		d = -d
	}
	return d
}

// Exp32 and its vector form (ExpShift) against math.Exp rounded to float32, on
// random arguments over the whole range a softmax sees, special points, and
// lengths that leave scalar tails.
func TestExp32(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	xs := []float32{0, -0, 1, -1, 0.5, -0.3465736, 0.3465736, 88, -87, -80, 20, -20}
	for range 200_000 {
		xs = append(xs, float32(rng.Float64()*170-85))
	}
	for range 100_000 {
		xs = append(xs, float32(rng.NormFloat64()*4))
	}
	for _, n := range []int{len(xs), 7, 8, 9, 33} {
		src := xs[:n]
		shift := float32(0.75)
		got := make([]float32, n)
		ExpShift(got, src, shift)
		for i, x := range src {
			want := float32(math.Exp(float64(x - shift)))
			if x-shift < -87.33654 { // clamped: at most the smallest normal
				if got[i] > 1.18e-38 || Exp32(x-shift) > 1.18e-38 {
					t.Fatalf("exp(%v) = %v, %v: want at most 1.18e-38", x-shift, got[i], Exp32(x-shift))
				}
				continue
			}
			if u := ulps(got[i], want); u > 3 {
				t.Fatalf("n=%d: exp(%v - %v) = %v, want %v (%d ulp)", n, x, shift, got[i], want, u)
			}
			if s := Exp32(x - shift); ulps(s, want) > 3 {
				t.Fatalf("Exp32(%v) = %v, want %v", x-shift, s, want)
			}
		}
	}
	if got := Exp32(-200); got > 1.2e-38 {
		t.Errorf("Exp32(-200) = %v, want at most the smallest normal", got)
	}
	if got := Exp32(100); got < math.MaxFloat32 {
		t.Errorf("Exp32(100) = %v, want huge", got)
	}
}
