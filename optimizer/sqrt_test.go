package optimizer

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func mklOrSkip(t *testing.T) Sqrt {
	t.Helper()
	q, ok := MKLSqrt()
	if !ok {
		t.Skip("no AVX2: MKLSqrt cannot be computed on this CPU")
	}
	return q
}

// TestMKLSqrtValues checks what MKLSqrt must give whatever the CPU's
// reciprocal square root approximation: within one ulp of the IEEE square
// root (MKL's high-accuracy mode), not the IEEE function itself, and MKL's
// scalar results where its vector code hands a lane over.
func TestMKLSqrtValues(t *testing.T) {
	q := mklOrSkip(t)
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
	if differ == 0 || differ > len(x)/2 {
		t.Errorf("%d of %d results differ from the IEEE square root, want some (MKL's arithmetic is not correctly rounded)", differ, len(x))
	}

	cases := []struct {
		x    uint32
		want uint32
	}{
		{0x00000000, 0x00000000}, // +0
		{0x80000000, 0x80000000}, // -0
		{0x7f800000, 0x7f800000}, // +inf
		{0xff800000, 0x7fc00000}, // -inf: MKL's positive NaN (VSQRTPS gives 0xFFC00000)
		{0xbf800000, 0x7fc00000}, // -1
		{0x80000001, 0x7fc00000}, // the smallest negative subnormal
		{0x7fa00001, 0x7fe00001}, // a signalling NaN comes back quiet, payload kept
		{0xffc01234, 0xffc01234}, // a negative quiet NaN passes through
		{0x00000001, math.Float32bits(Sqrt32(math.Float32frombits(1)))},          // subnormals: IEEE
		{0x007fffff, math.Float32bits(Sqrt32(math.Float32frombits(0x007fffff)))}, //
		{0x7f7fffff, math.Float32bits(Sqrt32(math.MaxFloat32))},                  // the largest 4095: IEEE
		{0x7f7ff001, math.Float32bits(Sqrt32(math.Float32frombits(0x7f7ff001)))}, //
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
}

// TestMKLSqrtTail: the last partial group of 8 gets the results it would get
// inside a group.
func TestMKLSqrtTail(t *testing.T) {
	q := mklOrSkip(t)
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
				t.Fatalf("n=%d: element %d is %g, %g in a full group", n, i, y[i], all[len(x)-n+i])
			}
		}
	}
}

// TestMKLSqrtOnePassMatchesBlocks: the step's one-pass kernel with MKLSqrt
// computes what the two-pass blocks compute calling the same function.
func TestMKLSqrtOnePassMatchesBlocks(t *testing.T) {
	q := mklOrSkip(t)
	r := rand.New(rand.NewPCG(25, 26))
	hypers := []Hyper{
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01},
		{LR: 3e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6},
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1, Maximize: true},
		{LR: 5e-2, Beta1: 0.3, Beta2: 0.95, Eps: 1e-3, WeightDecay: 0.5},
		{LR: 1e-2, Beta1: 0.8, Beta2: 0.9, Eps: 1e-8, WeightDecay: 0.01, Amsgrad: true},
	}
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
						t.Fatalf("%+v n=%d %v: buffer %d element %d differs from the blocks' result", h, n, l, i, j)
					}
				}
			}
		}
	}
}

// TestCheckMKLSqrtRejects: CheckMKLSqrt finds a library that differs from
// the emulation in one input of each class it covers, and accepts an equal
// one. (The comparison with MKL itself is in package vml's tests.)
func TestCheckMKLSqrtRejects(t *testing.T) {
	q := mklOrSkip(t)
	if err := CheckMKLSqrt(q.Apply, 2); err != nil {
		t.Fatalf("the emulation against itself: %v", err)
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
		err := CheckMKLSqrt(off, 2)
		if err == nil || !strings.Contains(err.Error(), "emulation") {
			t.Errorf("a library wrong at %#08x passed the check (%v)", bad, err)
		}
	}
	if err := CheckMKLSqrt(ieeeSqrt, 1); err == nil {
		t.Error("the IEEE square root passed the check")
	}
}
