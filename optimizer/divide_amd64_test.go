package optimizer

import (
	"math"
	"math/rand/v2"
	"testing"
)

// divisors are values of bias_correction2_sqrt the kernels divide by: those
// of common and extreme beta2 over a run's steps (as ScalarsFor rounds them),
// the ends of the range divisorOK allows, and random ones across it.
func divisors(r *rand.Rand, random int) []float32 {
	var out []float32
	for _, b2 := range []float64{0, 0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 0.99999, 1 - 0x1p-53} {
		for _, step := range []int64{1, 2, 3, 7, 10, 100, 1000, 4567, 1e5, 1e7} {
			out = append(out, ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: b2, Eps: 1e-8}, step).f32().bc2s)
		}
	}
	out = append(out, 1, 0.5, 0x1p-32, math.Nextafter32(1, 0), math.Nextafter32(0x1p-32, 1))
	for range random {
		out = append(out, float32(math.Exp2(-32*r.Float64())))
	}
	seen := map[float32]bool{}
	uniq := out[:0]
	for _, b := range out {
		if divisorOK(b) && !seen[b] {
			seen[b] = true
			uniq = append(uniq, b)
		}
	}
	return uniq
}

// quotients are the numerators: every significand in [1, 2) (every stride-th
// one when stride > 1), samples at every exponent a square root can have
// (2^-75 to 2^64) and at both ends, and the special values a square root
// gives: +-0, +inf and NaNs of every kind (signalling ones included).
func numerators(r *rand.Rand, stride int) []float32 {
	var xs []float32
	for i := 0; i < 1<<23; i += stride {
		xs = append(xs, math.Float32frombits(0x3F800000|uint32(i)))
	}
	for e := -75; e <= 63; e++ {
		for range 256 {
			xs = append(xs, float32(math.Ldexp(1+r.Float64(), e)))
		}
	}
	xs = append(xs, float32(math.Sqrt(math.SmallestNonzeroFloat32)), float32(math.Sqrt(math.MaxFloat32)), 0x1p-75, 0x1p64)
	for _, bits := range []uint32{0, 0x80000000, 0x7F800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
		0x7FA5A5A5, 0xFFDEAD01, 0x7FFFFFFF, 0xFFFFFFFF} {
		xs = append(xs, math.Float32frombits(bits))
	}
	for len(xs)%16 != 0 {
		xs = append(xs, 1.5)
	}
	return xs
}

// TestDivideByRecip: the kernels' division by bc2s through its reciprocal
// (divide_amd64.h) is Go's float32 division, bit for bit, NaN payloads
// included, at each assembly level the CPU has; every significand for the
// divisors of common beta2, a sample of them for the others (-short: fewer).
func TestDivideByRecip(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 41))
	bs := divisors(r, 40)
	full, sampled := numerators(r, 1), numerators(r, 97)
	if testing.Short() {
		full = sampled
		bs = bs[:8]
	}
	levels := []struct {
		name string
		isa  ISA
		div  func(dst, src *float32, n int, k *vecConsts)
	}{{"avx2", ISAAVX2, divBCAVX2}, {"avx512", ISAAVX512, divBCAVX512}}
	for _, l := range levels {
		t.Run(l.name, func(t *testing.T) {
			if cpuISA < l.isa {
				t.Skipf("the CPU lacks %s", l.name)
			}
			for i, b := range bs {
				xs := sampled
				if i%4 == 0 { // a quarter of the divisors, the common beta2's first among them, get every significand
					xs = full
				}
				c := vecConsts{bc2s: b}
				c.setWide()
				got := make([]float32, len(xs))
				l.div(&got[0], &xs[0], len(xs), &c)
				for j, x := range xs {
					if want := x / b; math.Float32bits(got[j]) != math.Float32bits(want) {
						t.Fatalf("%#x / %#x (b = %g): got %#x, want %#x", math.Float32bits(x), math.Float32bits(b), b,
							math.Float32bits(got[j]), math.Float32bits(want))
					}
				}
			}
			t.Logf("%d divisors", len(bs))
		})
	}
}
