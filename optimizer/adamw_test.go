package optimizer

import (
	"math"
	"math/big"
	"math/rand/v2"
	"strings"
	"testing"
)

// The references below restate torch's _single_tensor_adam op by op, over
// whole arrays, the way the Python code reads: every op is one rounding to
// the tensor's dtype, fused multiply-adds are exact (exactFMA32), the square
// root is the exact one rounded once. They share no code with adamw.go.

func bf(x float32) float32 { return BF16ToF32(F32ToBF16(x)) }

func exactSqrt32(x float32) float32 {
	if x < 0 || x != x {
		return float32(math.NaN())
	}
	r, _ := new(big.Float).SetPrec(200).Sqrt(bigOf(x)).Float32()
	return r
}

func refMax32(a, b float32) float32 {
	if a != a || b != b {
		return float32(math.NaN())
	}
	if a > b {
		return a
	}
	return b
}

// refStepF32 is one AdamW step of float32 tensors.
func refStepF32(p, g, m, v, vmax []float32, s Scalars) {
	n := len(p)
	decay, w, b2, omb2 := float32(s.Decay), float32(s.Beta1W), float32(s.Beta2), float32(s.OneMinusB2)
	negStep, bc2s, eps := float32(s.NegStepSize), float32(s.BC2Sqrt), float32(s.Eps)
	grad := append([]float32(nil), g...)
	if s.Maximize { // grad = -grad
		for i := range grad {
			grad[i] = -grad[i]
		}
	}
	if s.ApplyDecay { // param.mul_(1 - lr*wd)
		for i := range p {
			p[i] = float32(p[i] * decay)
		}
	}
	for i := range m { // exp_avg.lerp_(grad, 1-beta1)
		m[i] = exactLerp32(m[i], grad[i], w)
	}
	for i := range v { // exp_avg_sq.mul_(beta2)
		v[i] = float32(v[i] * b2)
	}
	for i := range v { // .addcmul_(grad, grad, value=1-beta2)
		v[i] = exactFMA32(float32(omb2*grad[i]), grad[i], v[i])
	}
	src := v
	if s.Amsgrad { // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
		for i := range vmax {
			vmax[i] = refMax32(vmax[i], v[i])
		}
		src = vmax
	}
	denom := make([]float32, n)
	for i := range denom { // .sqrt()
		denom[i] = exactSqrt32(src[i])
	}
	for i := range denom { // / bias_correction2_sqrt
		denom[i] = float32(denom[i] / bc2s)
	}
	for i := range denom { // .add_(eps)
		denom[i] = float32(denom[i] + eps)
	}
	for i := range p { // param.addcdiv_(exp_avg, denom, value=-step_size)
		p[i] = float32(p[i] + float32(float32(negStep*m[i])/denom[i]))
	}
}

// refStepBF16 is one AdamW step of bfloat16 tensors: each op computes in
// float32 and rounds to bfloat16; add_'s scalar eps is a bfloat16.
func refStepBF16(p, g, m, v, vmax []uint16, s Scalars) {
	n := len(p)
	decay, w, b2, omb2 := float32(s.Decay), float32(s.Beta1W), float32(s.Beta2), float32(s.OneMinusB2)
	negStep, bc2s, eps := float32(s.NegStepSize), float32(s.BC2Sqrt), bf(float32(s.Eps))
	grad := make([]float32, n)
	for i := range grad {
		grad[i] = BF16ToF32(g[i])
		if s.Maximize {
			grad[i] = -grad[i]
		}
	}
	if s.ApplyDecay {
		for i := range p {
			p[i] = F32ToBF16(float32(BF16ToF32(p[i]) * decay))
		}
	}
	for i := range m {
		m[i] = F32ToBF16(exactLerp32(BF16ToF32(m[i]), grad[i], w))
	}
	for i := range v {
		v[i] = F32ToBF16(float32(BF16ToF32(v[i]) * b2))
	}
	for i := range v {
		v[i] = F32ToBF16(exactFMA32(float32(omb2*grad[i]), grad[i], BF16ToF32(v[i])))
	}
	src := v
	if s.Amsgrad {
		for i := range vmax {
			vmax[i] = F32ToBF16(refMax32(BF16ToF32(vmax[i]), BF16ToF32(v[i])))
		}
		src = vmax
	}
	denom := make([]float32, n)
	for i := range denom {
		denom[i] = bf(exactSqrt32(BF16ToF32(src[i])))
	}
	for i := range denom {
		denom[i] = bf(float32(denom[i] / bc2s))
	}
	for i := range denom {
		denom[i] = bf(float32(denom[i] + eps))
	}
	for i := range p {
		p[i] = F32ToBF16(float32(BF16ToF32(p[i]) + float32(float32(negStep*BF16ToF32(m[i]))/denom[i])))
	}
}

func randNormal32(r *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * scale)
	}
	return x
}

func randSq32(r *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		y := r.NormFloat64() * scale
		x[i] = float32(y * y)
	}
	return x
}

func toBF16(x []float32) []uint16 {
	h := make([]uint16, len(x))
	for i, f := range x {
		h[i] = F32ToBF16(f)
	}
	return h
}

func f32Equal(t *testing.T, what string, got, want []float32) bool {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Errorf("%s[%d] = %g (%#08x), want %g (%#08x)", what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
			return false
		}
	}
	return true
}

func u16Equal(t *testing.T, what string, got, want []uint16) bool {
	t.Helper()
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("%s[%d] = %#04x, want %#04x", what, i, got[i], want[i])
			return false
		}
	}
	return true
}

var stepConfigs = []struct {
	name string
	h    Hyper
}{
	{"default", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}},
	{"weight_decay=0", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}},
	{"amsgrad", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Amsgrad: true}},
	{"maximize", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2, Maximize: true}},
	{"amsgrad+maximize, wd=0", Hyper{LR: 3e-2, Beta1: 0.8, Beta2: 0.99, Eps: 1e-6, Amsgrad: true, Maximize: true}},
	{"large lr and decay, beta1=0", Hyper{LR: 0.5, Beta1: 0, Beta2: 0.5, Eps: 1e-3, WeightDecay: 0.3}},
}

// TestStepF32MatchesReference runs several steps from a random (nonzero)
// state on sizes around the kernel's block size.
func TestStepF32MatchesReference(t *testing.T) {
	for _, cfg := range stepConfigs {
		for _, n := range []int{1, 7, 513, 1500} {
			r := rand.New(rand.NewPCG(uint64(n), 11))
			p := randNormal32(r, n, 1)
			m := randNormal32(r, n, 1e-2)
			v := randSq32(r, n, 1e-2)
			vmax := randSq32(r, n, 1e-2)
			rp, rm, rv, rvmax := clone(p), clone(m), clone(v), clone(vmax)
			for step := int64(1); step <= 4; step++ {
				g := randNormal32(r, n, 1e-2)
				if step == 3 {
					for i := 0; i < n; i += 3 {
						g[i] = 0 // zero gradients in the mix
					}
				}
				s := ScalarsFor(cfg.h, step)
				gcopy := clone(g)
				StepF32(p, g, m, v, vmax, s, Sqrt{})
				refStepF32(rp, g, rm, rv, rvmax, s)
				if !f32Equal(t, cfg.name+" grad (must be read-only)", g, gcopy) {
					return
				}
				ok := f32Equal(t, cfg.name+" param", p, rp) && f32Equal(t, cfg.name+" exp_avg", m, rm) &&
					f32Equal(t, cfg.name+" exp_avg_sq", v, rv)
				if cfg.h.Amsgrad {
					ok = ok && f32Equal(t, cfg.name+" max_exp_avg_sq", vmax, rvmax)
				} else {
					ok = ok && f32Equal(t, cfg.name+" max_exp_avg_sq untouched", vmax, rvmax)
				}
				if !ok {
					t.Fatalf("%s: n=%d step %d differs from the reference", cfg.name, n, step)
				}
			}
		}
	}
}

func TestStepBF16MatchesReference(t *testing.T) {
	for _, cfg := range stepConfigs {
		for _, n := range []int{1, 7, 513, 1500} {
			r := rand.New(rand.NewPCG(uint64(n), 12))
			p := toBF16(randNormal32(r, n, 1))
			m := toBF16(randNormal32(r, n, 1e-2))
			v := toBF16(randSq32(r, n, 1e-2))
			vmax := toBF16(randSq32(r, n, 1e-2))
			rp, rm, rv, rvmax := clone(p), clone(m), clone(v), clone(vmax)
			for step := int64(1); step <= 4; step++ {
				g := toBF16(randNormal32(r, n, 1e-2))
				s := ScalarsFor(cfg.h, step)
				StepBF16(p, g, m, v, vmax, s)
				refStepBF16(rp, g, rm, rv, rvmax, s)
				ok := u16Equal(t, cfg.name+" param", p, rp) && u16Equal(t, cfg.name+" exp_avg", m, rm) &&
					u16Equal(t, cfg.name+" exp_avg_sq", v, rv) && u16Equal(t, cfg.name+" max_exp_avg_sq", vmax, rvmax)
				if !ok {
					t.Fatalf("%s: n=%d step %d differs from the reference", cfg.name, n, step)
				}
			}
		}
	}
}

// TestStepF32Sensitivity checks that the data of these tests tell apart
// formulas that differ only in rounding: an unfused addcmul, and no
// rounding of the intermediate denominator, must give other bits.
func TestStepF32Sensitivity(t *testing.T) {
	const n = 1500
	r := rand.New(rand.NewPCG(13, 14))
	p, g := randNormal32(r, n, 1), randNormal32(r, n, 1e-2)
	m, v := randNormal32(r, n, 1e-2), randSq32(r, n, 1e-2)
	s := ScalarsFor(stepConfigs[0].h, 3)
	vp, vm, vv := clone(p), clone(m), clone(v)
	StepF32(vp, g, vm, vv, nil, s, Sqrt{})

	// Unfused addcmul: two roundings.
	uv := clone(v)
	diffV := 0
	for i := range uv {
		x := float32(uv[i] * float32(s.Beta2))
		x = float32(x + float32(float32(float32(s.OneMinusB2)*g[i])*g[i]))
		if x != vv[i] {
			diffV++
		}
	}
	// Unfused lerp.
	diffM := 0
	for i := range m {
		w := float32(s.Beta1W)
		x := float32(m[i] + float32(w*float32(g[i]-m[i])))
		if x != vm[i] {
			diffM++
		}
	}
	if diffV == 0 || diffM == 0 {
		t.Errorf("data cannot tell fused from unfused ops: addcmul differs in %d, lerp in %d of %d", diffV, diffM, n)
	}
}

func TestStepF32CustomSqrt(t *testing.T) {
	// The sqrt argument is used for every element, in blocks of callBlock
	// (a tail included).
	const n = 2*callBlock + 1100
	r := rand.New(rand.NewPCG(15, 16))
	p, g := randNormal32(r, n, 1), randNormal32(r, n, 1e-2)
	m, v := randNormal32(r, n, 1e-2), randSq32(r, n, 1e-2)
	s := ScalarsFor(stepConfigs[0].h, 2)
	calls, total := 0, 0
	low := func(dst, src []float32) { // one ulp below IEEE, never above
		calls++
		total += len(src)
		for i, x := range src {
			y := Sqrt32(x)
			if y > 0 {
				y = math.Nextafter32(y, 0)
			}
			dst[i] = y
		}
	}
	p1, m1, v1 := clone(p), clone(m), clone(v)
	StepF32(p1, g, m1, v1, nil, s, CallSqrt(low))
	p2, m2, v2 := clone(p), clone(m), clone(v)
	StepF32(p2, g, m2, v2, nil, s, Sqrt{})
	if total != n || calls != (n+callBlock-1)/callBlock {
		t.Errorf("sqrt called %d times for %d elements, want %d times for %d", calls, total, (n+callBlock-1)/callBlock, n)
	}
	diff := 0
	for i := range p1 {
		if p1[i] != p2[i] {
			diff++
		}
	}
	if diff == 0 {
		t.Error("a different square root did not change any parameter")
	}
}

func TestScalarsFor(t *testing.T) {
	h := Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	// Values from CPython: 1 - lr*wd, 1 - beta1, 1 - beta2,
	// -(lr / (1 - beta1**step)), (1 - beta2**step) ** 0.5.
	cases := []struct {
		step          int64
		negStep, bc2s float64
	}{
		{1, -0.010000000000000002, 0.031622776601683805},
		{2, -0.005263157894736844, 0.04471017781221601},
		{10, -0.0015353399327876296, 0.09977534660552057},
	}
	for _, tc := range cases {
		s := ScalarsFor(h, tc.step)
		want := Scalars{Decay: 0.99999, ApplyDecay: true, Beta1W: 0.09999999999999998, Beta2: 0.999,
			OneMinusB2: 0.0010000000000000009, NegStepSize: tc.negStep, BC2Sqrt: tc.bc2s, Eps: 1e-8}
		if tc.step > 2 {
			// Go's math.Pow is not libm's pow (see ScalarsFor's comment):
			// 0.999**10 is one ulp off, which 1 - x magnifies to ~6e-15
			// relative. Compare to a relative 1e-13.
			for _, c := range [][2]float64{{s.NegStepSize, want.NegStepSize}, {s.BC2Sqrt, want.BC2Sqrt}} {
				if math.Abs(c[0]-c[1]) > 1e-13*math.Abs(c[1]) {
					t.Errorf("step %d: %v, want %v", tc.step, c[0], c[1])
				}
			}
			s.NegStepSize, s.BC2Sqrt = want.NegStepSize, want.BC2Sqrt
		}
		if s != want {
			t.Errorf("ScalarsFor(step %d) = %+v, want %+v", tc.step, s, want)
		}
	}
	// Flags and weight_decay = 0.
	s := ScalarsFor(Hyper{LR: 0.1, Beta1: 0.5, Beta2: 0.75, Eps: 0.25, Amsgrad: true, Maximize: true}, 2)
	want := Scalars{Decay: 1, ApplyDecay: false, Beta1W: 0.5, Beta2: 0.75, OneMinusB2: 0.25,
		NegStepSize: -0.1 / 0.75, BC2Sqrt: math.Sqrt(1 - 0.5625), Eps: 0.25, Amsgrad: true, Maximize: true}
	if s != want {
		t.Errorf("ScalarsFor(flags) = %+v, want %+v", s, want)
	}
	// torch keeps the step count in a float32 tensor: 2^24+1 reads as 2^24.
	// (Betas this close to 1 keep beta**step away from 0.)
	hl := Hyper{LR: 1e-3, Beta1: 1 - 1e-9, Beta2: 1 - 1e-10}
	if a, b := ScalarsFor(hl, 1<<24+1), ScalarsFor(hl, 1<<24); a != b {
		t.Errorf("step 2^24+1 gives %+v, want the scalars of step 2^24 %+v", a, b)
	}
	if a, b := ScalarsFor(hl, 1<<24+2), ScalarsFor(hl, 1<<24); a == b {
		t.Error("steps 2^24+2 and 2^24 give the same scalars")
	}
	if a, b := ScalarsFor(Hyper{LR: 1, Beta1: 0.5, Beta2: 0.5}, 3), ScalarsFor(Hyper{LR: 1, Beta1: 0.5, Beta2: 0.5}, 4); a == b {
		t.Error("steps 3 and 4 give the same scalars")
	}
}

func TestHyperValidate(t *testing.T) {
	ok := Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	nan, inf := math.NaN(), math.Inf(1)
	cases := []struct {
		name    string
		mod     func(*Hyper)
		wantErr string // "" means valid
	}{
		{"defaults", func(h *Hyper) {}, ""},
		{"all zero", func(h *Hyper) { *h = Hyper{} }, ""},
		{"beta just below 1", func(h *Hyper) { h.Beta1, h.Beta2 = math.Nextafter(1, 0), math.Nextafter(1, 0) }, ""},
		{"negative lr", func(h *Hyper) { h.LR = -1e-3 }, "learning rate"},
		{"nan lr", func(h *Hyper) { h.LR = nan }, "learning rate"},
		{"inf lr", func(h *Hyper) { h.LR = inf }, "learning rate"},
		{"negative eps", func(h *Hyper) { h.Eps = -1 }, "epsilon"},
		{"nan eps", func(h *Hyper) { h.Eps = nan }, "epsilon"},
		{"inf eps", func(h *Hyper) { h.Eps = inf }, "epsilon"},
		{"beta1 = 1", func(h *Hyper) { h.Beta1 = 1 }, "index 0"},
		{"beta1 < 0", func(h *Hyper) { h.Beta1 = -0.1 }, "index 0"},
		{"beta1 nan", func(h *Hyper) { h.Beta1 = nan }, "index 0"},
		{"beta2 = 1", func(h *Hyper) { h.Beta2 = 1 }, "index 1"},
		{"beta2 nan", func(h *Hyper) { h.Beta2 = nan }, "index 1"},
		{"negative weight decay", func(h *Hyper) { h.WeightDecay = -1e-2 }, "weight_decay"},
		{"nan weight decay", func(h *Hyper) { h.WeightDecay = nan }, "weight_decay"},
		{"inf weight decay", func(h *Hyper) { h.WeightDecay = inf }, "weight_decay"},
	}
	for _, tc := range cases {
		h := ok
		tc.mod(&h)
		err := h.Validate()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tc.name, err)
		case tc.wantErr != "" && err == nil:
			t.Errorf("%s: accepted %+v", tc.name, h)
		case tc.wantErr != "" && !strings.Contains(err.Error(), tc.wantErr):
			t.Errorf("%s: error %q does not mention %q", tc.name, err, tc.wantErr)
		}
	}
}

func TestAddF32AndBF16(t *testing.T) {
	dst := []float32{1, 0x1p-24, -2, 3.5}
	AddF32(dst, []float32{0x1p-24, 1, 2, -0.25})
	// 1 + 2^-24 ties to 1 in float32 (not 1 + 2^-24 as float64 would keep).
	want := []float32{1, 1, 0, 3.25}
	f32Equal(t, "AddF32", dst, want)

	h := []uint16{F32ToBF16(1), F32ToBF16(256), F32ToBF16(-3)}
	AddBF16(h, []uint16{F32ToBF16(0x1p-8), F32ToBF16(1.5), F32ToBF16(1)})
	// 1 + 2^-8 ties to 1 in bfloat16; 256 + 1.5 rounds to 258 (spacing 2).
	u16Equal(t, "AddBF16", h, []uint16{F32ToBF16(1), F32ToBF16(258), F32ToBF16(-2)})
}

func clone[T any](x []T) []T { return append([]T(nil), x...) }
