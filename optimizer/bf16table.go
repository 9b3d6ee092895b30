package optimizer

import "sync/atomic"

// bf16Table is what the bfloat16 single-tensor kernel of ISAAVX512VBMI
// (stepBF16AVX512VBMI) looks up instead of computing it: the first two
// stages of torch's denominator, d = bf16(bf16(sqrt(v)) / bc2s), for the
// new exp_avg_sq v of every element.
//
// Both roundings commute with scaling by a power of two while the values are
// normal floats, and for a positive normal v they are (the root is at least
// 2^-63, bc2s in [2^-32, 1] makes d at most 2^96). So with v = 4^k x, x
// having v's mantissa and the biased exponent 127 or 128 by the parity of
// v's (bit 7 of its bits), d(v) = 2^k d(x): d's bits are d(x)'s plus 128k.
// The 256 values of x (bit 7 and the mantissa: the low byte of v's bits)
// index bytes: byte i is d(x)'s bits less (127+q)*128, where q is the
// exponent of d(1), the least of them (d grows with x); they fit a byte as
// d(x) is below 2^(q+2). The kernel adds ((E+127)/2 + q)*128 for v's biased
// exponent E, which is (v + bias + 1) / 2 with bias = 0x3F7F + 256q, its
// low 7 bits cleared (VPAVGW, VPANDD): 127+k+q, in the exponent field.
//
// The kernel looks up only positive normal v; a zero, subnormal, infinite,
// NaN or negative one sends its pair to the integer roundings.
// TestBF16TableAllValues compares the lookup with the two stages for every
// positive normal bfloat16 and many bc2s.
type bf16Table struct {
	bytes [256]byte
	bias  [32]uint16 // 0x3F7F + 256q in every word (VPAVGW's operand)
}

// bf16TableFor is a table with the bc2s it was made for.
type bf16TableFor struct {
	bc2s float32
	ok   bool
	t    bf16Table
}

// lastBF16Table is the table made last: every tensor of a training step
// (and every chunk of a tensor) has the same bc2s, so a step makes one.
var lastBF16Table atomic.Pointer[bf16TableFor]

// divisorOK says whether the kernels' shortcuts for dividing by bc2s hold:
// bc2s in [2^-32, 1], which every beta2 in [0, 1) gives (bc2s >= 2^-26.5).
// There the kernels may divide through its reciprocal (divide_amd64.h), and
// the quotient of a square root by it stays a normal float32, as the table
// below needs; outside, the step runs in Go (or without the table).
func divisorOK(bc2s float32) bool { return bc2s >= 0x1p-32 && bc2s <= 1 }

// fill sets t to bc2s's table and reports whether there is one: where
// divisorOK(bc2s).
func (t *bf16Table) fill(bc2s float32) bool {
	last := lastBF16Table.Load()
	if last == nil || last.bc2s != bc2s {
		last = &bf16TableFor{bc2s: bc2s}
		last.ok = last.t.make(bc2s)
		lastBF16Table.Store(last)
	}
	*t = last.t
	return last.ok
}

// sqrtDivBF16 is the two stages of StepBF16 the table holds, for the
// bfloat16 v: its square root rounded, divided by bc2s, rounded.
func sqrtDivBF16(v uint16, bc2s float32) uint16 {
	s := BF16ToF32(F32ToBF16(Sqrt32(BF16ToF32(v))))
	return F32ToBF16(float32(s / bc2s))
}

// make computes bc2s's table; false if bc2s is out of range.
func (t *bf16Table) make(bc2s float32) bool {
	if !divisorOK(bc2s) {
		return false
	}
	var d [256]uint16
	for i := range d {
		e := uint16(128) // bit 7 clear: an even biased exponent
		if i&0x80 != 0 {
			e = 127
		}
		d[i] = sqrtDivBF16(e<<7|uint16(i&0x7F), bc2s)
	}
	q := int(d[0x80]>>7) - 127 // d(1)
	if q < 0 {
		return false
	}
	base := uint16(127+q) << 7
	for i, x := range d {
		if x < base || x-base > 0xFF {
			return false
		}
		t.bytes[i] = byte(x - base)
	}
	for i := range t.bias {
		t.bias[i] = 0x3F7F + uint16(q)<<8
	}
	return true
}

// lookup is the kernel's arithmetic for a positive normal bfloat16 v
// (TestBF16TableAllValues).
func (t *bf16Table) lookup(v uint16) uint16 {
	avg := uint16((uint32(v) + uint32(t.bias[0]) + 1) >> 1)
	return avg&0xFF80 + uint16(t.bytes[v&0xFF])
}
