package optimizer

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

// exactPrec is enough bits to hold a*b+c exactly for any float32 a, b, c:
// the exact sum spans at most 2^256 down to 2^-298.
const exactPrec = 1100

func bigOf(x float32) *big.Float {
	return new(big.Float).SetPrec(exactPrec).SetFloat64(float64(x))
}

// exactFMA32 is a*b+c computed exactly and rounded once to float32
// (nearest, ties to even), the reference for FMA32.
func exactFMA32(a, b, c float32) float32 {
	for _, x := range []float32{a, b, c} {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			// Any non-finite operand makes the result ±Inf or NaN, which
			// float64 arithmetic gets right (nothing is rounded).
			return float32(float64(float64(a)*float64(b)) + float64(c))
		}
	}
	p := bigOf(a)
	p.Mul(p, bigOf(b))
	p.Add(p, bigOf(c))
	r, _ := p.Float32()
	return r
}

// exactLerp32 is torch's vectorized CPU lerp with one exact rounding per
// operation: d = end-start rounded, then fma(w, d, start) when |w| < 0.5,
// else fma(w-1, d, end).
func exactLerp32(start, end, w float32) float32 {
	d := float32(end - start)
	if math.Abs(float64(w)) < 0.5 {
		return exactFMA32(w, d, start)
	}
	return exactFMA32(float32(w-1), d, end)
}

func sameBits(a, b float32) bool {
	if a != a && b != b {
		return true // both NaN; payloads are not part of FMA32's contract
	}
	return math.Float32bits(a) == math.Float32bits(b)
}

// isMidpoint reports whether the float64 s lies exactly halfway between two
// adjacent float32 values (with an unbounded exponent above MaxFloat32).
func isMidpoint(s float64) bool {
	if s == 0 || math.IsInf(s, 0) || math.IsNaN(s) {
		return false
	}
	x := new(big.Float).SetPrec(exactPrec).SetFloat64(s)
	// Round to 25 bits: a midpoint has exactly 25 significant bits (or
	// fewer in the subnormal range, handled below) with the last one set.
	e := x.MantExp(nil) // s = m * 2^e, 0.5 <= |m| < 1
	// Spacing of float32 values around s: 2^(e-24) for normal numbers,
	// 2^-149 for subnormals.
	ulpExp := max(e-24, -149)
	q := new(big.Float).SetPrec(exactPrec).SetMantExp(x, -(ulpExp - 1)) // s in units of half ulps
	if !q.IsInt() {
		return false
	}
	qi, _ := q.Int(nil)
	return qi.Bit(0) == 1
}

// doubleRoundingTie reports whether float32(float64(a*b)+c) rounds twice
// through a float32 midpoint with a nonzero residual: the case a naive
// float32(math.FMA(...)) can get wrong.
func doubleRoundingTie(a, b, c float32) bool {
	p := float64(float64(a) * float64(b))
	s := float64(p + float64(c))
	if !isMidpoint(s) {
		return false
	}
	ex := bigOf(a)
	ex.Mul(ex, bigOf(b))
	ex.Add(ex, bigOf(c))
	return ex.Cmp(new(big.Float).SetFloat64(s)) != 0
}

func TestExactReferenceRounding(t *testing.T) {
	// The reference itself: big.Float.Float32 must round to nearest even,
	// including gradual underflow and overflow.
	tiny := math.SmallestNonzeroFloat32
	cases := []struct {
		name string
		x    *big.Float
		want float32
	}{
		{"0.75 of smallest subnormal rounds up", new(big.Float).SetFloat64(0.75 * tiny), float32(tiny)},
		{"half of smallest subnormal ties to 0", new(big.Float).SetFloat64(0.5 * tiny), 0},
		{"1.5 subnormal ulps tie to 2", new(big.Float).SetFloat64(1.5 * tiny), float32(2 * tiny)},
		{"just below overflow midpoint", new(big.Float).SetPrec(exactPrec).Sub(new(big.Float).SetFloat64(0x1p128-0x1p103), big.NewFloat(1)), math.MaxFloat32},
		{"overflow midpoint ties to inf", new(big.Float).SetFloat64(0x1p128 - 0x1p103), float32(math.Inf(1))},
		{"1+2^-24 ties to 1", new(big.Float).SetFloat64(1 + 0x1p-24), 1},
		{"1+3*2^-24 ties to 1+2^-22", new(big.Float).SetFloat64(1 + 3*0x1p-24), 1 + 0x1p-22},
	}
	for _, tc := range cases {
		got, _ := tc.x.Float32()
		if !sameBits(got, tc.want) {
			t.Errorf("%s: got %g (%#x), want %g", tc.name, got, math.Float32bits(got), tc.want)
		}
	}
	if !isMidpoint(1+0x1p-24) || isMidpoint(1) || isMidpoint(1+0x1p-25) || !isMidpoint(0x1p-150) || !isMidpoint(0x1p128-0x1p103) {
		t.Error("isMidpoint is wrong")
	}
}

func TestFMA32Crafted(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := float32(math.NaN())
	maxF := float32(math.MaxFloat32)
	sub := float32(math.SmallestNonzeroFloat32)
	cases := []struct {
		name    string
		a, b, c float32
	}{
		{"simple", 2, 3, 4},
		{"exact cancellation gives +0", 1, 1, -1},
		{"-0 + -0", -1, 0, float32(math.Copysign(0, -1))},
		{"-0 + +0", -1, 0, 0},
		{"product rounds, c small", 1 + 0x1p-23, 1 + 0x1p-23, 0x1p-60},
		{"fma keeps product low bits", 1 + 0x1p-12, 1 - 0x1p-12, -1},
		{"tie below, odd c", (1 + 0x1p-23) * 0x1p-10, (1 - 0x1p-23) * 0x1p-14, 1 + 0x1p-23},
		{"tie below, even c", (1 + 0x1p-23) * 0x1p-10, (1 - 0x1p-23) * 0x1p-14, 1 + 0x1p-22},
		{"tie above, odd c", -(1 + 0x1p-23) * 0x1p-10, (1 - 0x1p-23) * 0x1p-14, 1 + 0x1p-23},
		{"subnormal product", 0x1p-75, 0x1.8p-74, 0},
		{"subnormal tie", (1 + 0x1p-23) * 0x1p-75, (1 - 0x1p-23) * 0x1p-75, 3 * sub},
		{"subnormal tie, negative", -(1 + 0x1p-23) * 0x1p-75, (1 - 0x1p-23) * 0x1p-75, -3 * sub},
		{"underflow to zero", 0x1p-80, 0x1p-80, 0},
		{"cancellation into subnormal", 0x1p-63 * (1 + 0x1p-23), 0x1p-63, -0x1p-126},
		{"smallest normal from product", 0x1p-63, 0x1p-63, 0},
		{"overflow", maxF, 2, 0},
		{"overflow negative", maxF, -2, 0},
		{"max stays max", maxF, 1, 0x1p100},
		{"product overflows float32, c brings nothing back", 0x1p100, 0x1p100, -maxF},
		{"product above max, c brings it back", maxF, 1 + 0x1p-23, -maxF},
		{"overflow midpoint, exact above", 18631 * 0x1p60, 1801 * 0x1p43, 1},
		{"inf operand", inf, 2, 1},
		{"inf times zero", inf, 0, 1},
		{"inf minus inf", inf, 1, -inf},
		{"nan a", nan, 1, 1},
		{"nan c", 1, 1, nan},
	}
	for _, tc := range cases {
		got, want := FMA32(tc.a, tc.b, tc.c), exactFMA32(tc.a, tc.b, tc.c)
		if !sameBits(got, want) {
			t.Errorf("%s: FMA32(%g, %g, %g) = %g (%#08x), want %g (%#08x)", tc.name, tc.a, tc.b, tc.c,
				got, math.Float32bits(got), want, math.Float32bits(want))
		}
	}
}

// TestFMA32OverflowTie covers a*b+c whose float64 rounding is the midpoint
// between MaxFloat32 and 2^128 while the exact value lies below it: the
// correctly rounded result is MaxFloat32, not +Inf.
func TestFMA32OverflowTie(t *testing.T) {
	a, b := float32(18631*0x1p60), float32(1801*0x1p43) // a*b = 2^128 - 2^103 exactly
	for _, sign := range []float32{1, -1} {
		got, want := FMA32(sign*a, b, -sign), exactFMA32(sign*a, b, -sign)
		if want != sign*math.MaxFloat32 {
			t.Fatalf("reference: got %g, want %g", want, sign*math.MaxFloat32)
		}
		if !sameBits(got, want) {
			t.Skipf("known bug (FMA32 overflow tie, see fp.go): FMA32 = %g, want %g", got, want)
		}
	}
}

func randF32(r *rand.Rand, minExp, maxExp int) float32 {
	m := 1 + float64(r.Uint32N(1<<23))*0x1p-23
	e := minExp + r.IntN(maxExp-minExp+1)
	x := float32(math.Ldexp(m, e))
	if r.IntN(2) == 0 {
		x = -x
	}
	return x
}

func TestFMA32Random(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	n := 60000
	if testing.Short() {
		n = 10000
	}
	type gen struct {
		name string
		f    func() (a, b, c float32)
	}
	gens := []gen{
		{"any bits", func() (float32, float32, float32) {
			return math.Float32frombits(r.Uint32()), math.Float32frombits(r.Uint32()), math.Float32frombits(r.Uint32())
		}},
		{"moderate", func() (float32, float32, float32) {
			return randF32(r, -20, 20), randF32(r, -20, 20), randF32(r, -40, 40)
		}},
		{"near cancellation", func() (float32, float32, float32) {
			a, b := randF32(r, -30, 30), randF32(r, -30, 30)
			c := -float32(float64(a) * float64(b))
			c = math.Float32frombits(math.Float32bits(c) + uint32(r.IntN(5)) - 2)
			return a, b, c
		}},
		{"subnormal results", func() (float32, float32, float32) {
			a := randF32(r, -80, -60)
			b := randF32(r, -150-int(math.Floor(math.Log2(math.Abs(float64(a))))), -120-int(math.Floor(math.Log2(math.Abs(float64(a))))))
			c := float32(0)
			if r.IntN(2) == 0 {
				c = math.Float32frombits(r.Uint32N(1<<23) | uint32(r.IntN(2))<<31) // subnormal
			}
			return a, b, c
		}},
		{"near overflow", func() (float32, float32, float32) {
			a := randF32(r, 60, 70)
			b := randF32(r, 125-int(math.Floor(math.Log2(math.Abs(float64(a))))), 128-int(math.Floor(math.Log2(math.Abs(float64(a))))))
			return a, b, randF32(r, 120, 127)
		}},
	}
	for _, g := range gens {
		bad := 0
		for range n {
			a, b, c := g.f()
			got, want := FMA32(a, b, c), exactFMA32(a, b, c)
			if !sameBits(got, want) {
				bad++
				if bad <= 5 {
					t.Errorf("%s: FMA32(%g, %g, %g) = %g (%#08x), want %g (%#08x)", g.name, a, b, c,
						got, math.Float32bits(got), want, math.Float32bits(want))
				}
			}
		}
		if bad > 0 {
			t.Errorf("%s: %d of %d wrong", g.name, bad, n)
		}
	}
}

// TestFMA32DoubleRoundingTies builds a*b+c whose float64 sum lands exactly on
// a float32 midpoint while the exact value does not, in two ways, and checks
// that the naive double rounding really fails there while FMA32 does not.
func TestFMA32DoubleRoundingTies(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	type triple struct{ a, b, c float32 }
	var small, large []triple

	// Family 1: the product is half an ulp of c (times 1 - i^2 2^-46), so c
	// plus it rounds in float64 to c ± half ulp; c normal or subnormal.
	for len(small) < 3000 {
		i := float64(1 + r.IntN(250))
		var c float32
		var hExp int // c's half ulp is 2^hExp
		if r.IntN(4) == 0 {
			c = math.Float32frombits(1 + r.Uint32N(1<<23-1)) // subnormal
			hExp = -150
		} else {
			c = randF32(r, -100, 100)
			_, e := math.Frexp(math.Abs(float64(c)))
			hExp = e - 1 - 24
		}
		ka := -40 + r.IntN(80)
		kb := hExp - ka
		if kb < -126 || kb > 127 {
			continue
		}
		a := float32(math.Ldexp(1+i*0x1p-23, ka))
		b := float32(math.Ldexp(1-i*0x1p-23, kb))
		if r.IntN(2) == 0 {
			a = -a
		}
		if r.IntN(2) == 0 {
			c = -c
		}
		if doubleRoundingTie(a, b, c) {
			small = append(small, triple{a, b, c})
		}
	}
	// Family 2: the product sits a little off a float32 midpoint and a small
	// c cancels the offset up to a residual below float64 resolution.
	for tries := 0; len(large) < 3000 && tries < 50_000_000; tries++ {
		A := uint64(1<<23 | r.Uint32N(1<<23))
		B := uint64(1<<23 | r.Uint32N(1<<23))
		AB := A * B // 2^46 <= AB < 2^48
		top := 47
		if AB < 1<<47 {
			top = 46
		}
		unit := uint64(1) << (top - 24) // half ulp of AB in float32
		d := int64(AB%(2*unit)) - int64(unit)
		if d == 0 || d > 1<<15 || d < -(1<<15) {
			continue
		}
		rho := int64(1)
		if r.IntN(2) == 0 {
			rho = -1
		}
		// c = -d + rho*2^(top-55) in units of a*b's last bit: the residual
		// is below half a float64 ulp of AB (2^(top-53)).
		cBig := new(big.Float).SetPrec(exactPrec).SetInt64(-d)
		cBig.Add(cBig, new(big.Float).SetMantExp(big.NewFloat(float64(rho)), top-55))
		c, acc := cBig.Float32()
		if acc != big.Exact {
			continue
		}
		sa := -40 + r.IntN(60)
		sb := -40 + r.IntN(60)
		a := float32(math.Ldexp(float64(A), sa-23))
		b := float32(math.Ldexp(float64(B), sb-23))
		cs := math.Ldexp(float64(c), sa+sb-46)
		if float64(float32(cs)) != cs {
			continue
		}
		c = float32(cs)
		if r.IntN(2) == 0 {
			a, c = -a, -c
		}
		if doubleRoundingTie(a, b, c) {
			large = append(large, triple{a, b, c})
		}
	}
	for _, fam := range []struct {
		name string
		ts   []triple
	}{{"product is half an ulp of c", small}, {"c cancels product offset", large}} {
		if len(fam.ts) < 1000 {
			t.Fatalf("%s: only %d tie cases built", fam.name, len(fam.ts))
		}
		naiveWrong, bad := 0, 0
		for _, tc := range fam.ts {
			want := exactFMA32(tc.a, tc.b, tc.c)
			if !sameBits(float32(math.FMA(float64(tc.a), float64(tc.b), float64(tc.c))), want) {
				naiveWrong++
			}
			if got := FMA32(tc.a, tc.b, tc.c); !sameBits(got, want) {
				bad++
				if bad <= 5 {
					t.Errorf("%s: FMA32(%g, %g, %g) = %g, want %g", fam.name, tc.a, tc.b, tc.c, got, want)
				}
			}
		}
		// About half of the ties round the wrong way when rounded twice;
		// otherwise the cases would not test anything.
		if naiveWrong < len(fam.ts)/4 {
			t.Errorf("%s: naive double rounding wrong in only %d of %d cases", fam.name, naiveWrong, len(fam.ts))
		}
		if bad > 0 {
			t.Errorf("%s: %d of %d wrong", fam.name, bad, len(fam.ts))
		}
	}
}

func TestF32ToBF16(t *testing.T) {
	cases := []struct {
		name string
		in   uint32
		want uint16
	}{
		{"one", 0x3F800000, 0x3F80},
		{"below tie rounds down", 0x3F807FFF, 0x3F80},
		{"tie to even stays", 0x3F808000, 0x3F80},
		{"above tie rounds up", 0x3F808001, 0x3F81},
		{"tie from odd rounds up", 0x3F818000, 0x3F82},
		{"negative tie to even", 0xBF808000, 0xBF80},
		{"negative tie from odd", 0xBF818000, 0xBF82},
		{"carry into exponent", 0x3FFFC000, 0x4000},
		{"+0", 0x00000000, 0x0000},
		{"-0", 0x80000000, 0x8000},
		{"subnormal tie to even", 0x00008000, 0x0000},
		{"subnormal tie from odd", 0x00018000, 0x0002},
		{"smallest subnormal", 0x00000001, 0x0000},
		{"subnormal rounds to smallest normal", 0x007FFFFF, 0x0080},
		{"+inf", 0x7F800000, 0x7F80},
		{"-inf", 0xFF800000, 0xFF80},
		{"quiet NaN", 0x7FC00000, 0x7FC0},
		{"signalling NaN", 0x7F800001, 0x7FC0},
		{"NaN payload in low bits only", 0x7F80FFFF, 0x7FC0},
		{"negative NaN", 0xFFC00001, 0x7FC0},
		{"max float32 overflows to inf", 0x7F7FFFFF, 0x7F80},
		{"max bfloat16 stays", 0x7F7F0000, 0x7F7F},
		{"just below max bfloat16 tie", 0x7F7F7FFF, 0x7F7F},
		{"max bfloat16 tie rounds to inf", 0x7F7F8000, 0x7F80},
		{"-max float32", 0xFF7FFFFF, 0xFF80},
	}
	for _, tc := range cases {
		if got := F32ToBF16(math.Float32frombits(tc.in)); got != tc.want {
			t.Errorf("%s: F32ToBF16(%#08x) = %#04x, want %#04x", tc.name, tc.in, got, tc.want)
		}
	}
}

// refBF16 rounds a finite float32 to bfloat16 by picking the nearer of the
// two neighbours by value, ties to the even one.
func refBF16(f float32) uint16 {
	u := math.Float32bits(f)
	lo := uint16(u >> 16)
	hi := lo + 1
	dlo := math.Abs(float64(f) - float64(BF16ToF32(lo)))
	vhi := float64(BF16ToF32(hi))
	if hi&0x7F80 == 0x7F80 && hi&0x7F == 0 { // hi is ±inf: use the value 2^128
		vhi = math.Copysign(0x1p128, float64(f))
	}
	dhi := math.Abs(vhi - float64(f))
	switch {
	case dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case lo&1 == 0:
		return lo
	}
	return hi
}

func TestF32ToBF16Random(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 200000 {
		u := r.Uint32()
		if u&0x7F800000 == 0x7F800000 {
			continue // inf and NaN are in the table
		}
		if r.IntN(4) == 0 {
			u = u&^0xFFFF | 0x8000 // a tie
		}
		f := math.Float32frombits(u)
		if got, want := F32ToBF16(f), refBF16(f); got != want {
			t.Fatalf("F32ToBF16(%#08x) = %#04x, want %#04x", u, got, want)
		}
	}
}

func TestBF16RoundTrip(t *testing.T) {
	for h := range 1 << 16 {
		x := uint16(h)
		f := BF16ToF32(x)
		if math.Float32bits(f) != uint32(x)<<16 {
			t.Fatalf("BF16ToF32(%#04x) = %#08x", x, math.Float32bits(f))
		}
		want := x
		if x&0x7F80 == 0x7F80 && x&0x7F != 0 {
			want = 0x7FC0 // every NaN becomes the canonical one
		}
		if got := F32ToBF16(f); got != want {
			t.Fatalf("F32ToBF16(BF16ToF32(%#04x)) = %#04x, want %#04x", x, got, want)
		}
	}
}

func TestLerp32(t *testing.T) {
	cases := []struct {
		name            string
		start, end, w   float32
		want            float32
		wantFromFormula bool // want is exactLerp32's value
	}{
		{"w=0 gives start", 3, 7, 0, 3, false},
		{"w=1 gives end exactly", 0.1, 0.7, 1, 0.7, false},
		{"w=0.5 midpoint", 2, 4, 0.5, 3, false},
		{"small w", 1, 2, 0.1, 0, true},
		{"negative small w", 1, 2, -0.3, 0, true},
		{"w just below 0.5", 1.5, -2.25, math.Nextafter32(0.5, 0), 0, true},
		{"large w", 1, 2, 0.9, 0, true},
		{"w above 1", 1, 2, 1.5, 0, true},
		{"negative large w", 1, 2, -0.7, 0, true},
	}
	for _, tc := range cases {
		want := tc.want
		if tc.wantFromFormula {
			want = exactLerp32(tc.start, tc.end, tc.w)
		}
		if got := Lerp32(tc.start, tc.end, tc.w); !sameBits(got, want) {
			t.Errorf("%s: Lerp32(%g, %g, %g) = %g, want %g", tc.name, tc.start, tc.end, tc.w, got, want)
		}
	}

	// Random operands in both branches. The two branch formulas must differ
	// for some operands, or the test could not tell a swapped branch.
	r := rand.New(rand.NewPCG(7, 8))
	for _, br := range []struct {
		name   string
		weight func() float32
	}{
		{"w<0.5", func() float32 { return float32(r.Float64() * 0.5) }},
		{"w>=0.5", func() float32 { return float32(0.5 + r.Float64()*0.5) }},
		{"adamw weight 1-0.9", func() float32 { return float32(1 - 0.9) }},
	} {
		otherDiffers := 0
		for range 20000 {
			s, e, w := randF32(r, -8, 2), randF32(r, -8, 2), br.weight()
			got, want := Lerp32(s, e, w), exactLerp32(s, e, w)
			if !sameBits(got, want) {
				t.Fatalf("%s: Lerp32(%g, %g, %g) = %g, want %g", br.name, s, e, w, got, want)
			}
			d := float32(e - s)
			other := exactFMA32(float32(w-1), d, e)
			if math.Abs(float64(w)) >= 0.5 {
				other = exactFMA32(w, d, s)
			}
			if !sameBits(other, want) {
				otherDiffers++
			}
		}
		if otherDiffers == 0 {
			t.Errorf("%s: the other branch's formula never differs: test cannot see the branch", br.name)
		}
	}
}

func TestMax32(t *testing.T) {
	nan := float32(math.NaN())
	inf := float32(math.Inf(1))
	cases := []struct {
		a, b, want float32
	}{
		{1, 2, 2},
		{2, 1, 2},
		{-1, -2, -1},
		{inf, 1, inf},
		{-inf, -1, -1},
		{3, 3, 3},
		{nan, 1, nan},
		{1, nan, nan},
		{nan, nan, nan},
		{-inf, nan, nan},
		{nan, inf, nan},
	}
	for _, tc := range cases {
		got := Max32(tc.a, tc.b)
		if tc.want != tc.want {
			if got == got {
				t.Errorf("Max32(%g, %g) = %g, want NaN", tc.a, tc.b, got)
			}
			continue
		}
		if got != tc.want {
			t.Errorf("Max32(%g, %g) = %g, want %g", tc.a, tc.b, got, tc.want)
		}
	}
}

func TestSqrt32(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	for range 20000 {
		x := math.Float32frombits(r.Uint32N(0x7F800000)) // finite, >= 0
		got := Sqrt32(x)
		want, _ := new(big.Float).SetPrec(200).Sqrt(bigOf(x)).Float32()
		if !sameBits(got, want) {
			t.Fatalf("Sqrt32(%g) = %g, want %g", x, got, want)
		}
	}
}
