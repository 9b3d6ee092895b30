package optimizer

import (
	"bytes"
	"flag"
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"unsafe"
)

// asmLevels are the assembly levels this CPU runs, each compared with the Go
// code by the tests below.
func asmLevels(t *testing.T) []ISA {
	var l []ISA
	for i := ISAAVX2; i <= cpuISA; i++ {
		l = append(l, i)
	}
	if len(l) == 0 {
		t.Skip("no AVX2+FMA on this CPU: only the Go code exists")
	}
	return l
}

// withISA runs f with the kernels at level l.
func withISA(l ISA, f func() [][]byte) [][]byte {
	old := vecISA
	vecISA = l
	defer func() { vecISA = old }()
	return f()
}

var requireISA = flag.String("require-isa", os.Getenv("SONAR_REQUIRE_ISA"),
	"fail unless the kernels run at this level (avx512vbmi, avx512bf16, avx512, avx2, go); env SONAR_REQUIRE_ISA")

// TestRequiredISA fails where -require-isa (or SONAR_REQUIRE_ISA) names a
// level this CPU lacks, so a run meant to check AVX-512 (make test-avx512,
// scripts/gpu-check) cannot pass by skipping it.
func TestRequiredISA(t *testing.T) {
	name := *requireISA
	if name == "" {
		t.Skip("-require-isa not given")
	}
	want, err := ParseISA(name)
	if err != nil {
		t.Fatal(err)
	}
	if cpuISA < want || vecISA < want {
		t.Fatalf("this CPU runs %v (kernels at %v), the run requires %v", cpuISA, vecISA, want)
	}
	t.Logf("kernels at %v", vecISA)
}

func TestISANames(t *testing.T) {
	for _, l := range []ISA{ISAGo, ISAAVX2, ISAAVX512, ISAAVX512BF16} {
		got, err := ParseISA(l.String())
		if err != nil || got != l {
			t.Errorf("ParseISA(%q) = %v, %v", l.String(), got, err)
		}
	}
	if _, err := ParseISA("sse"); err == nil {
		t.Error("ParseISA(sse): no error")
	}
	old := vecISA
	defer func() { vecISA = old }()
	if got := LimitISA(ISAAVX512BF16 + 1); got != cpuISA {
		t.Errorf("LimitISA above the CPU = %v, want the CPU's %v", got, cpuISA)
	}
	if got := LimitISA(ISAGo); got != ISAGo || KernelISA() != ISAGo {
		t.Errorf("LimitISA(go) = %v, KernelISA %v", got, KernelISA())
	}
}

// specials are the inputs whose handling differs most between instruction
// sets: NaN, infinities, signed zeros, subnormals and the largest finite value.
var specials = []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 0, float32(math.Copysign(0, -1)),
	math.SmallestNonzeroFloat32, 1e-39, -3e-40, math.MaxFloat32}

// sprinkle writes the specials over x at scattered places (|s| where square).
func sprinkle(x []float32, r *rand.Rand, square bool) {
	if len(x) <= 40 {
		return
	}
	for j, s := range specials {
		if square && s < 0 {
			s = -s
		}
		x[(j*37+r.IntN(5))%len(x)] = s
	}
}

// TestAssemblyMatchesScalarPath runs every kernel at each assembly level and
// in Go and requires identical bytes: the paths must perform the same IEEE
// operations lane for lane.
func TestAssemblyMatchesScalarPath(t *testing.T) {
	levels := asmLevels(t)
	cases := []struct {
		name string
		h    Hyper
	}{
		{"default", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}},
		{"no-decay", Hyper{LR: 3e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6}},
		{"maximize", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1, Maximize: true}},
		{"lerp-weight-over-half", Hyper{LR: 5e-2, Beta1: 0.3, Beta2: 0.95, Eps: 1e-3, WeightDecay: 0.5}},
	}
	r := rand.New(rand.NewPCG(7, 8))
	for _, c := range cases {
		for _, n := range []int{8, 9, 16, 24, 31, 33, 511, 512, 513, 1031, 4096 + 77, 4096 + 512 + 24} {
			mk := func() []float32 {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(r.NormFloat64() * float64(int(1)<<r.IntN(8)) / 64)
				}
				return x
			}
			p, g, m, v := mk(), mk(), mk(), mk()
			for i := range v {
				v[i] *= v[i]
			}
			sprinkle(p, r, false)
			sprinkle(g, r, false)
			sprinkle(m, r, false)
			sprinkle(v, r, true)
			for _, bf := range []bool{false, true} {
				run := func() [][]byte {
					if bf {
						cv := func(x []float32) []uint16 {
							o := make([]uint16, n)
							for i := range o {
								o[i] = F32ToBF16(x[i])
							}
							return o
						}
						pp, gg, mm, vv := cv(p), cv(g), cv(m), cv(v)
						for step := int64(1); step <= 3; step++ {
							StepBF16(pp, gg, mm, vv, nil, ScalarsFor(c.h, step))
						}
						return [][]byte{u16b(pp), u16b(mm), u16b(vv)}
					}
					pp, mm, vv := append([]float32(nil), p...), append([]float32(nil), m...), append([]float32(nil), v...)
					for step := int64(1); step <= 3; step++ {
						StepF32(pp, g, mm, vv, nil, ScalarsFor(c.h, step), Sqrt{})
					}
					return [][]byte{f32b(pp), f32b(mm), f32b(vv)}
				}
				// Against Go, a NaN may come out with another sign or payload
				// (which NaN operand an instruction passes on is not fixed in Go
				// code; the Python tests compare NaN positions only). The
				// assembly levels share their operand order: identical bytes.
				s := withISA(ISAGo, run)
				var prev [][]byte
				for _, l := range levels {
					a := withISA(l, run)
					for i := range a {
						if j := firstDiff(a[i], s[i], bf); j >= 0 {
							t.Fatalf("%s n=%d bf16=%v: buffer %d element %d differs between %v and Go", c.name, n, bf, i, j, l)
						}
						if prev != nil && !bytes.Equal(a[i], prev[i]) {
							t.Fatalf("%s n=%d bf16=%v: buffer %d differs between %v and %v", c.name, n, bf, i, l, l-1)
						}
					}
					prev = a
				}
			}
		}
	}
}

// firstDiff is the first element where a and b (float32, or bfloat16 bit
// patterns) differ, counting two NaNs as equal; -1 if none.
func firstDiff(a, b []byte, bf bool) int {
	if bf {
		x, y := b2u16(a), b2u16(b)
		for i := range x {
			if x[i] != y[i] && !(x[i]&0x7FFF > 0x7F80 && y[i]&0x7FFF > 0x7F80) {
				return i
			}
		}
		return -1
	}
	x, y := b2f32(a), b2f32(b)
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) && !(x[i] != x[i] && y[i] != y[i]) {
			return i
		}
	}
	return -1
}

func f32b(x []float32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x)) }
func u16b(x []uint16) []byte  { return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 2*len(x)) }

// TestFusedAssemblyMatchesScalarPath is TestAssemblyMatchesScalarPath for the
// fused kernels: every hyper-parameter branch, sizes with and without a
// tail, chunks that start inside the tensor (as the engine's workers get
// them), float32 and bfloat16 with 8, 16 and 32 lanes (torch's AVX2 and AVX-512
// builds), special values included.
func TestFusedAssemblyMatchesScalarPath(t *testing.T) {
	levels := asmLevels(t)
	cases := []struct {
		name string
		h    Hyper
	}{
		{"default", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}},
		{"no-decay", Hyper{LR: 3e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6}},
		{"maximize", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1, Maximize: true}},
		{"lerp-weight-over-half", Hyper{LR: 5e-2, Beta1: 0.3, Beta2: 0.95, Eps: 1e-3, WeightDecay: 0.5}},
		{"amsgrad", Hyper{LR: 1e-3, Beta1: 0.8, Beta2: 0.99, Eps: 1e-8, WeightDecay: 0.01, Amsgrad: true}},
	}
	r := rand.New(rand.NewPCG(9, 10))
	for _, c := range cases {
		for _, n := range []int{8, 15, 16, 17, 24, 33, 63, 511, 1031, 4096 + 77, 4096 + 512 + 24} {
			mk := func(square bool) []float32 {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(r.NormFloat64() * float64(int(1)<<r.IntN(8)) / 64)
					if square {
						x[i] *= x[i]
					}
				}
				sprinkle(x, r, square)
				return x
			}
			p, g, m, v, vm := mk(false), mk(false), mk(false), mk(true), mk(true)
			for _, lanes := range []int{8, 16, 32} {
				for _, bf := range []bool{false, true} {
					run := func() [][]byte {
						var out [][]byte
						// Two chunks, as two engine workers would update them.
						cut := (n / 2) &^ 3
						for step := int64(1); step <= 3; step++ {
							s := ScalarsFor(c.h, step)
							s.Fused, s.Lanes = true, lanes
							if bf {
								if out == nil {
									out = [][]byte{u16b(toBF(p)), u16b(toBF(g)), u16b(toBF(m)), u16b(toBF(v)), u16b(toBF(vm))}
								}
								pp, gg, mm, vv, xx := b2u16(out[0]), b2u16(out[1]), b2u16(out[2]), b2u16(out[3]), b2u16(out[4])
								FusedStepBF16(pp[:cut], gg[:cut], mm[:cut], vv[:cut], xx[:cut], s, 0, n)
								FusedStepBF16(pp[cut:], gg[cut:], mm[cut:], vv[cut:], xx[cut:], s, cut, n)
							} else {
								if out == nil {
									out = [][]byte{f32b(clone32(p)), f32b(g), f32b(clone32(m)), f32b(clone32(v)), f32b(clone32(vm))}
								}
								pp, gg, mm, vv, xx := b2f32(out[0]), b2f32(out[1]), b2f32(out[2]), b2f32(out[3]), b2f32(out[4])
								FusedStepF32(pp[:cut], gg[:cut], mm[:cut], vv[:cut], xx[:cut], s, 0, n)
								FusedStepF32(pp[cut:], gg[cut:], mm[cut:], vv[cut:], xx[cut:], s, cut, n)
							}
						}
						return out
					}
					s := withISA(ISAGo, run)
					for _, l := range levels {
						a := withISA(l, run)
						for i := range a {
							if !bytes.Equal(a[i], s[i]) {
								t.Fatalf("%s n=%d lanes=%d bf16=%v: buffer %d differs between %v and Go", c.name, n, lanes, bf, i, l)
							}
						}
					}
				}
			}
		}
	}
}

func toBF(x []float32) []uint16 {
	o := make([]uint16, len(x))
	for i := range o {
		o[i] = F32ToBF16(x[i])
	}
	return o
}

func clone32(x []float32) []float32 { return append([]float32(nil), x...) }
func b2f32(b []byte) []float32      { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }
func b2u16(b []byte) []uint16       { return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2) }

// TestStepBF16NaNPayloads holds what the bfloat16 step's assembly relies on
// to skip the NaN test in the roundings that are not stored (RBFI, ZRBFI):
// NaNs of any sign and payload in any input, signalling ones included, come
// out as 0x7FC0 in every stored buffer at every level, as the Go code
// stores them, and every other element is the Go code's bit for bit. The
// sizes reach the 32- and 16-element loops and the 8-lane tail.
func TestStepBF16NaNPayloads(t *testing.T) {
	levels := asmLevels(t)
	payloads := []uint16{0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFF80 | 0x40 | 1}
	r := rand.New(rand.NewPCG(11, 12))
	for _, n := range []int{8, 24, 56, 123, 32*5 + 16 + 8} {
		for buf := range 4 {
			mk := func() []uint16 {
				x := make([]uint16, n)
				for i := range x {
					x[i] = F32ToBF16(float32(r.NormFloat64() / 64))
				}
				return x
			}
			p, g, m, v := mk(), mk(), mk(), mk()
			for i := range v {
				v[i] &= 0x7FFF
			}
			in := [][]uint16{p, g, m, v}[buf]
			for j, q := range payloads {
				in[(j*13+r.IntN(7))%n] = q
			}
			run := func() [][]byte {
				pp, mm, vv := append([]uint16(nil), p...), append([]uint16(nil), m...), append([]uint16(nil), v...)
				h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1}
				for step := int64(1); step <= 2; step++ {
					StepBF16(pp, g, mm, vv, nil, ScalarsFor(h, step))
				}
				return [][]byte{u16b(pp), u16b(mm), u16b(vv)}
			}
			want := withISA(ISAGo, run)
			for _, l := range append([]ISA{ISAGo}, levels...) {
				got := withISA(l, run)
				for b := range got {
					x, y := b2u16(got[b]), b2u16(want[b])
					for i := range x {
						nan := x[i]&0x7FFF > 0x7F80
						if (nan && x[i] != 0x7FC0) || (!nan && x[i] != y[i]) || nan != (y[i]&0x7FFF > 0x7F80) {
							t.Fatalf("n=%d NaNs in input %d, %v: output %d element %d = %#04x, Go %#04x", n, buf, l, b, i, x[i], y[i])
						}
					}
				}
			}
		}
	}
}

// TestStepBF16TinyAndZero steps bfloat16 values near float32's smallest
// normal, zeros and ordinary values, mixed a block of 32 at a time, at
// every level against the Go code: the AVX-512 BF16 step rounds with
// VCVTNE2PS2BF16, which makes a subnormal a zero, and must find every block
// where p*decay, the new exp_avg, exp_avg_sq*beta2, the new exp_avg_sq or
// the new parameter is one, and step it again with torch's rounding.
func TestStepBF16TinyAndZero(t *testing.T) {
	levels := asmLevels(t)
	hypers := []Hyper{
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01},
		{LR: 1e-4, Beta1: 0.5, Beta2: 0.9, Eps: 1, WeightDecay: 0.5},
		{LR: 2e-2, Beta1: 0.99, Beta2: 0.5, Eps: 1e-30, Maximize: true},
		{LR: 1e-3, Beta1: 0.9, Beta2: 0.9, Eps: 1e-3, WeightDecay: 0.1},
	}
	r := rand.New(rand.NewPCG(21, 22))
	// A value of one of four kinds: ordinary, near 2^-126 (either side), zero,
	// or anywhere from 2^-140 to 2^-50 (what the step's products and sums
	// of such values need to land near 2^-126).
	val := func(kind int) float32 {
		sign := float32(1)
		if r.IntN(2) == 0 {
			sign = -1
		}
		switch kind {
		case 0:
			return sign * float32(r.NormFloat64()/64)
		case 1:
			return sign * float32(math.Ldexp(1+r.Float64(), -129+r.IntN(5)))
		case 2:
			return 0
		}
		return sign * float32(math.Ldexp(1+r.Float64(), -140+r.IntN(91)))
	}
	for _, h := range hypers {
		for _, n := range []int{32*24 + 16 + 8 + 5, 32 * 2000} {
			p, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
			for b := 0; b < n; b += 32 {
				// Each block draws the kind of each array: ordinary in most
				// blocks, so that blocks the vector loop keeps and blocks it
				// steps again alternate.
				kinds := [4]int{}
				if r.IntN(3) > 0 {
					for a := range kinds {
						kinds[a] = r.IntN(4)
					}
				}
				for i := b; i < min(b+32, n); i++ {
					for a, x := range [][]float32{p, g, m, v} {
						k := kinds[a]
						if k != 0 && r.IntN(4) == 0 {
							k = 0 // some ordinary lanes among the tiny ones
						}
						x[i] = val(k)
					}
					v[i] = float32(math.Abs(float64(v[i])))
				}
			}
			run := func() [][]byte {
				pp, gg, mm, vv := toBF(p), toBF(g), toBF(m), toBF(v)
				for step := int64(1); step <= 3; step++ {
					StepBF16(pp, gg, mm, vv, nil, ScalarsFor(h, step))
				}
				return [][]byte{u16b(pp), u16b(mm), u16b(vv)}
			}
			want := withISA(ISAGo, run)
			for _, l := range levels {
				got := withISA(l, run)
				for i := range got {
					if j := firstDiff(got[i], want[i], true); j >= 0 {
						t.Fatalf("%+v n=%d %v: buffer %d element %d = %#04x, Go %#04x", h, n, l, i, j,
							b2u16(got[i])[j], b2u16(want[i])[j])
					}
				}
			}
		}
	}
}

// bf16Stages is StepBF16's arithmetic for one element, returning the five
// float32 values the AVX-512 BF16 step checks before rounding each: p*decay,
// the new exp_avg, exp_avg_sq*beta2, the new exp_avg_sq and the new
// parameter.
func bf16Stages(p, g, m, v uint16, s Scalars) [5]float32 {
	k := s.f32()
	rb := func(x float32) float32 { return BF16ToF32(F32ToBF16(x)) }
	gi := BF16ToF32(g)
	if s.Maximize {
		gi = -gi
	}
	var st [5]float32
	st[0] = BF16ToF32(p)
	if s.ApplyDecay {
		st[0] = float32(st[0] * k.decay)
	}
	st[1] = Lerp32(BF16ToF32(m), gi, k.w)
	st[2] = float32(BF16ToF32(v) * k.b2)
	st[3] = FMA32(float32(k.omb2*gi), gi, rb(st[2]))
	den := rb(Sqrt32(rb(st[3])))
	den = rb(float32(den / k.bc2s))
	den = rb(float32(den + BF16ToF32(F32ToBF16(k.eps))))
	st[4] = float32(rb(st[0]) + float32(float32(k.negStep*rb(st[1]))/den))
	return st
}

// TestStepBF16EachCheck plants, in blocks of ordinary values, elements
// whose first step makes exactly one of bf16Stages' values subnormal (and
// none zero or NaN), or a NaN, or an infinite or NaN exp_avg_sq (which
// stepBF16AVX512VBMI's table has no entry for), so that each of the
// AVX-512 BF16 steps' checks alone must send its block to the exact
// rounding; then compares three steps at every level with the Go code, bit
// for bit.
func TestStepBF16EachCheck(t *testing.T) {
	levels := asmLevels(t)
	h := Hyper{LR: 1e-4, Beta1: 0.9, Beta2: 0.5, Eps: 1, WeightDecay: 0.01}
	s1 := ScalarsFor(h, 1)
	r := rand.New(rand.NewPCG(31, 32))
	tiny := func(lo, hi int) uint16 { // a bfloat16 of either sign, 2^lo to 2^hi
		x := float32(math.Ldexp(1+r.Float64(), lo+r.IntN(hi-lo+1)))
		if r.IntN(2) == 0 {
			x = -x
		}
		return F32ToBF16(x)
	}
	sub := func(x float32) bool { return x != 0 && math.Abs(float64(x)) < 0x1p-126 }
	// plant draws an element whose stage only is subnormal: p, g, m and v
	// from ranges that make it likely, the parameter (stage 4) or g (stage
	// 3, with a negative exp_avg_sq: state no step makes, but the kernels
	// take any input) aimed at a cancellation.
	plant := func(stage int) [4]uint16 {
		for range 1 << 20 {
			var e [4]uint16
			switch stage {
			case 0:
				e = [4]uint16{tiny(-127, -126), tiny(-40, -20), tiny(-40, -20), tiny(-40, -20) & 0x7FFF}
			case 1:
				e = [4]uint16{tiny(-40, -20), tiny(-135, -124), tiny(-130, -124), tiny(-40, -20) & 0x7FFF}
			case 2:
				e = [4]uint16{tiny(-40, -20), tiny(-62, -50), tiny(-40, -20), tiny(-127, -125) & 0x7FFF}
			case 3:
				e = [4]uint16{tiny(-40, -20), 0, tiny(-40, -20), tiny(-124, -118) | 0x8000}
				v1 := -float64(BF16ToF32(F32ToBF16(float32(BF16ToF32(e[3]) * float32(s1.Beta2)))))
				e[1] = F32ToBF16(float32(math.Sqrt(v1/s1.OneMinusB2) * (1 + (r.Float64()-0.5)/64)))
			case 4:
				e = [4]uint16{0, tiny(-115, -110), tiny(-115, -110), tiny(-40, -30) & 0x7FFF}
				q := float64(bf16Stages(0, e[1], e[2], e[3], s1)[4])
				e[0] = F32ToBF16(float32(-q * (1 + r.Float64()/64) / s1.Decay))
			}
			st := bf16Stages(e[0], e[1], e[2], e[3], s1)
			ok := true
			for j, x := range st {
				if x != x || math.IsInf(float64(x), 0) || F32ToBF16(x)&0x7FFF == 0 || sub(x) != (j == stage) {
					ok = false
				}
			}
			if ok {
				return e
			}
		}
		t.Fatalf("no element found with stage %d alone subnormal", stage)
		return [4]uint16{}
	}
	// Blocks of 32 go through the vector loop two at a time (then one,
	// then 16 and 8 elements): an element is planted in the first block of
	// every other pair and the second of the others, the partner block
	// ordinary, so that no other block's check covers a missing one; a sixth
	// kind is a NaN gradient, anywhere in its block, a seventh and an eighth
	// an infinite and a NaN exp_avg_sq (only exp_avg_sq's check sees them in
	// stepBF16AVX512VBMI: an infinite denominator leaves the parameter
	// finite, and the table's lookup turns a NaN into a number).
	const n = 32*201 + 16 + 8 + 3
	var in [4][]uint16
	for a := range in {
		in[a] = make([]uint16, n)
		for i := range in[a] {
			in[a][i] = F32ToBF16(float32(r.NormFloat64() / 64))
		}
	}
	for i := range in[3] {
		in[3][i] &= 0x7FFF
	}
	for b := 0; b < 201; b++ {
		if b%4 != 0 && b%4 != 3 {
			continue
		}
		i := 32*b + r.IntN(32)
		switch stage := (b / 4) % 8; {
		case stage < 5:
			e := plant(stage)
			for a := range in {
				in[a][i] = e[a]
			}
		case stage == 5:
			in[1][i] = 0x7FC0 | uint16(r.IntN(2))<<15
		case stage == 6: // a parameter small enough that a wrong finite denominator shows
			in[0][i], in[3][i] = tiny(-100, -95), 0x7F80
		default:
			in[3][i] = 0x7FC0 | uint16(r.IntN(64))
		}
	}
	// chunk 0 steps the whole tensor in one call; 32 steps each block in a
	// call of its own, which only the loop of one block at a time reaches.
	run := func(chunk int) func() [][]byte {
		return func() [][]byte {
			pp, mm, vv := append([]uint16(nil), in[0]...), append([]uint16(nil), in[2]...), append([]uint16(nil), in[3]...)
			c := chunk
			if c == 0 {
				c = n
			}
			for step := int64(1); step <= 3; step++ {
				for i := 0; i < n; i += c {
					j := min(i+c, n)
					StepBF16(pp[i:j], in[1][i:j], mm[i:j], vv[i:j], nil, ScalarsFor(h, step))
				}
			}
			return [][]byte{u16b(pp), u16b(mm), u16b(vv)}
		}
	}
	want := withISA(ISAGo, run(0))
	type call struct {
		l     ISA
		chunk int
	}
	var calls []call
	for _, l := range levels {
		calls = append(calls, call{l, 0})
	}
	calls = append(calls, call{levels[len(levels)-1], 32})
	for _, c := range calls {
		l, chunk := c.l, c.chunk
		got := withISA(l, run(chunk))
		for i := range got {
			// Exactly: a NaN is stored as 0x7FC0 at every level, as the Go
			// code stores it (TestStepBF16NaNPayloads).
			x, y := b2u16(got[i]), b2u16(want[i])
			for j := range x {
				if x[j] != y[j] {
					t.Fatalf("%v, calls of %d: buffer %d element %d (block %d) = %#04x, Go %#04x", l, chunk, i, j, j/32, x[j], y[j])
				}
			}
		}
	}
}
