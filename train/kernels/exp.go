package kernels

import "math"

// Exp32 is e^x in float32 arithmetic, within a few ulp of the correctly
// rounded value (TestExp32), as Cephes' expf computes it: x clamped to
// [-87.33654, 88.72283], Cody-Waite reduction x = n ln2 + r with |r| <=
// ln2/2, a degree-7 polynomial for e^r, the exponent n put in by its bits.
// The float32 training path uses it (ExpShift) in the softmaxes, the
// cross-entropy and SiLU instead of math.Exp, which cost 13-15% of a step;
// the float64 path (gradient checks) keeps math.Exp.
func Exp32(x float32) float32 {
	const (
		log2e = 1.44269504088896341
		ln2hi = 0.693359375
		ln2lo = -2.12194440e-4
	)
	x = min(max(x, -87.33654), 88.72283)
	n := float32(math.Floor(float64(x*log2e + 0.5)))
	r := x - n*ln2hi
	r -= n * ln2lo
	p := float32(1.9875691500e-4)
	p = p*r + 1.3981999507e-3
	p = p*r + 8.3334519073e-3
	p = p*r + 4.1665795894e-2
	p = p*r + 1.6666665459e-1
	p = p*r + 5.0000001201e-1
	p = p*r*r + r + 1
	return p * math.Float32frombits(uint32(int32(n)+127)<<23)
}

// ExpShift sets dst[i] = e^(src[i] - shift) (dst may be src): 8 at a time
// with AVX2 and FMA where the CPU has them, the rest with Exp32. The split
// depends only on the length, so results do not depend on the schedule.
func ExpShift(dst, src []float32, shift float32) {
	src = src[:len(dst)]
	n := 0
	if useKernel {
		n = len(dst) &^ 7
		if n > 0 {
			expShift8(&dst[0], &src[0], n, shift)
		}
	}
	for i := n; i < len(dst); i++ {
		dst[i] = Exp32(src[i] - shift)
	}
}
