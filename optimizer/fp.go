package optimizer

import "math"

// This file holds the scalar floating-point primitives the AdamW kernels are
// built from. Each one rounds exactly as the matching PyTorch CPU operation
// does, which is what makes the kernels bit-for-bit equal to torch.

// BF16ToF32 widens a bfloat16 bit pattern to float32 (exact).
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds a float32 to bfloat16 with round-to-nearest-even, as
// c10::BFloat16 does (NaN becomes the canonical quiet NaN 0x7FC0).
func F32ToBF16(f float32) uint16 {
	if f != f {
		return 0x7FC0
	}
	u := math.Float32bits(f)
	bias := uint32(0x7FFF) + ((u >> 16) & 1)
	return uint16((u + bias) >> 16)
}

// FMA32 returns a*b+c rounded once to float32, as a hardware single-precision
// fused multiply-add (vfmadd) does.
//
// The product of two float32 values is exact in float64, so the only
// rounding error of the float64 sum s is recovered exactly by TwoSum. Rounding
// s to float32 is a double rounding that can only go wrong when s lies exactly
// halfway between two float32 values; then the TwoSum residual decides the
// direction, which is the correctly rounded result.
func FMA32(a, b, c float32) float32 {
	p := float64(a) * float64(b) // exact
	cc := float64(c)
	s := p + cc
	r := float32(s)
	bits := math.Float64bits(s)
	exp := int((bits >> 52) & 0x7FF)
	// float32 normal range (|s| >= 2^-126): the 29 low mantissa bits of s are
	// those dropped by the rounding to float32; a midpoint has them 1000...0.
	if exp >= 1023-126 {
		if bits&(1<<29-1) != 1<<28 {
			return r
		}
	} else if float64(r) == s {
		return r
	}
	if math.IsInf(s, 0) || math.IsNaN(s) {
		return r
	}
	// TwoSum residual: p + cc == s + e exactly.
	bb := s - p
	e := (p - (s - bb)) + (cc - bb)
	if e == 0 {
		return r
	}
	// Neighbours of s in float32: r and the next float32 on the other side.
	var other float32
	if float64(r) > s {
		other = math.Nextafter32(r, float32(math.Inf(-1)))
	} else {
		other = math.Nextafter32(r, float32(math.Inf(1)))
	}
	lo, hi := r, other
	if lo > hi {
		lo, hi = hi, lo
	}
	lo64, hi64 := float64(lo), float64(hi)
	// Beyond MaxFloat32 the next "float32" is 2^128 (where rounding overflows).
	if math.IsInf(hi64, 1) {
		hi64 = 0x1p128
	}
	if math.IsInf(lo64, -1) {
		lo64 = -0x1p128
	}
	mid := (lo64 + hi64) / 2 // exact in float64
	switch {
	case s != mid:
		return r // not a tie: float32(s) already correctly rounded
	case e > 0:
		return hi
	default:
		return lo
	}
}

// Lerp32 is torch's CPU lerp for float32 operands: with |w| < 0.5 it is
// fma(w, end-start, start), otherwise fma(w-1, end-start, end), each
// difference rounded to float32 first.
func Lerp32(start, end, w float32) float32 {
	d := end - start
	if w < 0.5 && w > -0.5 {
		return FMA32(w, d, start)
	}
	return FMA32(w-1, d, end)
}

// Sqrt32 is the correctly rounded float32 square root.
func Sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }

// Max32 is torch.maximum for float32: NaN if either operand is NaN.
func Max32(a, b float32) float32 {
	if a != a || b != b {
		return float32(math.NaN())
	}
	if a > b {
		return a
	}
	return b
}
