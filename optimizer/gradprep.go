package optimizer

// ScaleF32 multiplies g by s in place (float32(g*s), one IEEE rounding, as
// torch's float32 grad.mul_(scale) does; s == 1 writes nothing) and, with
// norm, returns the sum of the squares of g before scaling, accumulated in
// float64.
func ScaleF32(g []float32, s float32, norm bool) float64 {
	var sum float64
	switch {
	case s == 1 && norm:
		for _, x := range g {
			sum += float64(x) * float64(x)
		}
	case norm:
		for i, x := range g {
			sum += float64(x) * float64(x)
			g[i] = x * s
		}
	case s != 1:
		for i, x := range g {
			g[i] = x * s
		}
	}
	return sum
}

// ScaleBF16 is ScaleF32 for bfloat16 gradients: each element becomes
// bf16(float32(g)*s), as torch's bfloat16 grad.mul_(scale) with a float32
// scale computes in float32 and rounds once.
func ScaleBF16(g []uint16, s float32, norm bool) float64 {
	var sum float64
	for i, h := range g {
		x := BF16ToF32(h)
		if norm {
			sum += float64(x) * float64(x)
		}
		if s != 1 {
			g[i] = F32ToBF16(x * s)
		}
	}
	return sum
}
