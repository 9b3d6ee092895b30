package optimizer

import (
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
)

// mklOrSkip returns the MKL emulations this CPU computes, each to be tested.
func mklOrSkip(t *testing.T) []Sqrt {
	t.Helper()
	qs := MKLSqrts()
	if len(qs) == 0 {
		t.Skip("no AVX2 and FMA: no MKL emulation on this CPU")
	}
	return qs
}

// TestMKLSqrtValues checks what each MKL emulation must give whatever the
// CPU's reciprocal square root approximation: within one ulp of the IEEE
// square root (MKL's high-accuracy mode), and
// MKL's scalar results where its vector code hands a lane over.
func TestMKLSqrtValues(t *testing.T) {
	for _, q := range mklOrSkip(t) {
		t.Run(q.String(), func(t *testing.T) {
			r := rand.New(rand.NewPCG(21, 22))
			x := make([]float32, 1<<16+5) // a tail of 5
			for i := range x {
				x[i] = float32(math.Ldexp(1+r.Float64(), r.IntN(200)-100))
			}
			y := make([]float32, len(x))
			q.Apply(y, x)
			differ := 0
			for i := range x {
				ieee := Sqrt32(x[i])
				if y[i] != ieee {
					differ++
					if y[i] != math.Nextafter32(ieee, 0) && y[i] != math.Nextafter32(ieee, float32(math.Inf(1))) {
						t.Fatalf("sqrt(%g) = %g, more than one ulp from %g", x[i], y[i], ieee)
					}
				}
			}
			// The SSE kernel's unfused step is not correctly rounded for a
			// good share of inputs (17% here); the FMA step is correctly
			// rounded far more often (none of these here).
			if differ > len(x)/2 || q.mkl == mklSSE && differ == 0 {
				t.Errorf("%d of %d results differ from the IEEE square root", differ, len(x))
			}

			ieee := func(x uint32) uint32 { return math.Float32bits(Sqrt32(math.Float32frombits(x))) }
			type tc struct{ x, want uint32 }
			cases := []tc{
				{0x00000000, 0x00000000}, // +0
				{0x80000000, 0x80000000}, // -0
				{0x7f800000, 0x7f800000}, // +inf
				{0xff800000, 0x7fc00000}, // -inf: MKL's positive NaN (VSQRTPS gives 0xFFC00000)
				{0xbf800000, 0x7fc00000}, // -1
				{0x80000001, 0x7fc00000}, // the smallest negative subnormal
				{0x7fa00001, 0x7fe00001}, // a signalling NaN comes back quiet, payload kept
				{0xffc01234, 0xffc01234}, // a negative quiet NaN passes through
			}
			if q.mkl != mklAVX512 { // subnormals go to MKL's scalar code: IEEE
				cases = append(cases, tc{0x00000001, ieee(1)}, tc{0x007fffff, ieee(0x7fffff)})
			}
			if q.mkl == mklSSE { // the SSE kernel's scalar code also takes the largest 4095
				cases = append(cases, tc{0x7f7fffff, ieee(0x7f7fffff)}, tc{0x7f7ff001, ieee(0x7f7ff001)})
			}
			in := make([]float32, len(cases))
			for i, c := range cases {
				in[i] = math.Float32frombits(c.x)
			}
			out := make([]float32, len(in))
			q.Apply(out, in)
			for i, c := range cases {
				if got := math.Float32bits(out[i]); got != c.want {
					t.Errorf("sqrt(%#08x) = %#08x, want %#08x", c.x, got, c.want)
				}
			}
		})
	}
}

// TestMKLSqrtTail: the last partial group of 8 gets the results it would get
// inside a group.
func TestMKLSqrtTail(t *testing.T) {
	for _, q := range mklOrSkip(t) {
		r := rand.New(rand.NewPCG(23, 24))
		x := make([]float32, 64)
		for i := range x {
			x[i] = r.Float32() * 100
		}
		all := make([]float32, len(x))
		q.Apply(all, x)
		for n := 1; n < 24; n++ {
			y := make([]float32, n)
			q.Apply(y, x[len(x)-n:])
			for i := range y {
				if math.Float32bits(y[i]) != math.Float32bits(all[len(x)-n+i]) {
					t.Fatalf("%v n=%d: element %d is %g, %g in a full group", q, n, i, y[i], all[len(x)-n+i])
				}
			}
		}
	}
}

// TestMKLSqrtOnePassMatchesBlocks: the step's one-pass kernel with each MKL
// emulation computes what the two-pass blocks compute calling the same
// function.
func TestMKLSqrtOnePassMatchesBlocks(t *testing.T) {
	qs := mklOrSkip(t)
	r := rand.New(rand.NewPCG(25, 26))
	hypers := []Hyper{
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01},
		{LR: 3e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6},
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1, Maximize: true},
		{LR: 5e-2, Beta1: 0.3, Beta2: 0.95, Eps: 1e-3, WeightDecay: 0.5},
		{LR: 1e-2, Beta1: 0.8, Beta2: 0.9, Eps: 1e-8, WeightDecay: 0.01, Amsgrad: true},
	}
	for _, q := range qs {
		for _, h := range hypers {
			for _, n := range []int{7, 8, 9, 31, 513, 4096 + 77, 3*4096 + 5} {
				mk := func(scale float64) []float32 {
					x := make([]float32, n)
					for i := range x {
						x[i] = float32(r.NormFloat64() * scale * float64(int(1)<<r.IntN(8)))
					}
					return x
				}
				p, g, m, v := mk(1), mk(1e-2), mk(1e-2), mk(1e-2)
				for i := range v {
					v[i] *= v[i]
				}
				sprinkle(p, r, false)
				sprinkle(g, r, false)
				sprinkle(v, r, true)
				run := func(sq Sqrt) [][]byte {
					pp, mm, vv := clone(p), clone(m), clone(v)
					vmax := make([]float32, n)
					for step := int64(1); step <= 3; step++ {
						StepF32(pp, g, mm, vv, vmax, ScalarsFor(h, step), sq)
					}
					return [][]byte{f32b(pp), f32b(mm), f32b(vv), f32b(vmax)}
				}
				want := run(CallSqrt(q.Apply))
				for _, l := range asmLevels(t) {
					got := withISA(l, func() [][]byte { return run(q) })
					for i := range got {
						if j := firstDiff(got[i], want[i], false); j >= 0 {
							t.Fatalf("%v %+v n=%d %v: buffer %d element %d differs from the blocks' result", q, h, n, l, i, j)
						}
					}
				}
			}
		}
	}
}

// TestCheckMKLSqrtRejects: CheckMKLSqrt finds a library that differs from
// an emulation in one input of each class it covers, and the other
// emulation; it accepts an equal one, and FindMKLSqrt picks it. (The
// comparison with MKL itself is in package vml's tests.)
func TestCheckMKLSqrtRejects(t *testing.T) {
	qs := mklOrSkip(t)
	for i, q := range qs {
		if err := CheckMKLSqrt(q, q.Apply, 2); err != nil {
			t.Fatalf("%v against itself: %v", q, err)
		}
		if got, err := FindMKLSqrt(q.Apply, 2); err != nil || got.String() != q.String() {
			t.Errorf("FindMKLSqrt(%v) = %v, %v", q, got, err)
		}
		other := qs[(i+1)%len(qs)]
		if err := CheckMKLSqrt(q, other.Apply, 2); err == nil {
			t.Errorf("%v passed the check against %v", q, other)
		}
		for _, bad := range []uint32{
			0x3fc00000, // 1.5
			0x407fffff, // just below 4
			0x00800000, // the smallest normal
			0x01234567, // the second lowest binade
			0x7f7fffff, // the largest finite
			0x00400000, // a subnormal
			0x00000000, // +0
			0x7f800000, // +inf
			0xc0000000, // -2
			0xff800000, // -inf
		} {
			off := func(dst, src []float32) {
				q.Apply(dst, src)
				for i, x := range src {
					if math.Float32bits(x) == bad {
						dst[i] = math.Float32frombits(math.Float32bits(dst[i]) ^ 1)
					}
				}
			}
			err := CheckMKLSqrt(q, off, 2)
			if err == nil || !strings.Contains(err.Error(), "emulation") {
				t.Errorf("%v: a library wrong at %#08x passed the check (%v)", q, bad, err)
			}
		}
	}
	// The unfused step is not correctly rounded on every input, whatever the
	// CPU's approximation (the FMA one may be, with some approximations).
	if err := CheckMKLSqrt(qs[0], ieeeSqrt, 1); qs[0].mkl != mklSSE || err == nil {
		t.Errorf("%v passed the check against the IEEE square root", qs[0])
	}
	if err := CheckMKLSqrt(Sqrt{}, ieeeSqrt, 1); err == nil {
		t.Error("CheckMKLSqrt accepted the IEEE square root as an emulation")
	}
}

// mklAVX512Golden is the FNV-1a hash (offset 1469598103934665603) of what
// MKL 2024.2's vmsSqrt (the mkl-static package of the version torch 2.15
// links, whose Z0HAynn kernel is instruction for instruction torch's) returned
// for mklGoldenInputs, on the emulated AVX-512 CPU of make test-avx512
// (Bochs, tigerlake), where MKL ran its AVX-512 kernel: 25,804,338 inputs,
// 2026-12-02. That program compared MKL with a C version of the emulation
// too: no difference.
const mklAVX512Golden = 0x830c13cccae53fae

// mklGoldenInputs calls f with the inputs of mklAVX512Golden in order, in
// batches: all of [1, 4), the two lowest normal binades every 7th, the
// binades between every 4099th, the two highest every 3rd, zero and the
// subnormals every 17th, and from +inf on every 65537th pattern.
func mklGoldenInputs(f func(x []float32)) {
	ranges := [][3]uint64{{0x3f800000, 0x40800000, 1}, {0x00800000, 0x01800000, 7}, {0x01800000, 0x7e800000, 4099},
		{0x7e800000, 0x7f800000, 3}, {0, 0x00800000, 17}, {0x7f800000, 1 << 32, 65537}}
	x := make([]float32, 0, 1<<16)
	for _, r := range ranges {
		for v := r[0]; v < r[1]; v += r[2] {
			x = append(x, math.Float32frombits(uint32(v)))
			if len(x) == cap(x) {
				f(x)
				x = x[:0]
			}
		}
	}
	if len(x) > 0 {
		f(x)
	}
}

// TestMKLSqrtAVX512MatchesMKL: the emulation of MKL's AVX-512 kernel gives
// what MKL gave on the same inputs in the same emulator (make test-avx512).
// Only there: Bochs's VRSQRT14PS is wrong for some inputs (2^-97 gives 2^49,
// not 2^48.5; 2^-149 gives 2^75), and MKL's results there inherit it as the
// emulation's do, so the hash holds where the instruction is Bochs's. The
// equality shows that the emulation performs MKL's operations; on a real
// AVX-512 CPU the check at load compares it with MKL itself.
func TestMKLSqrtAVX512MatchesMKL(t *testing.T) {
	if os.Getenv("SONAR_EMU") != "1" {
		t.Skip("the golden hash holds on make test-avx512's emulated CPU (SONAR_EMU=1) only")
	}
	var q Sqrt
	for _, e := range MKLSqrts() {
		if e.mkl == mklAVX512 {
			q = e
		}
	}
	if !q.IsMKLEmulation() {
		t.Skip("no AVX-512: the emulation of MKL's AVX-512 kernel cannot run here")
	}
	h, n := uint64(1469598103934665603), 0
	var y []float32
	mklGoldenInputs(func(x []float32) {
		y = append(y[:0], x...)
		q.Apply(y, x)
		for _, v := range y {
			b := math.Float32bits(v)
			for i := 0; i < 4; i++ {
				h = (h ^ uint64(byte(b>>(8*i)))) * 1099511628211
			}
		}
		n += len(x)
	})
	if n != 25804338 || h != mklAVX512Golden {
		t.Errorf("%d inputs hash to %#x, MKL's results to %#x", n, h, uint64(mklAVX512Golden))
	}
}
