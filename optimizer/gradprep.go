package optimizer

// ScaleF32 multiplies g by s in place (float32(g*s), one IEEE rounding, as
// torch's float32 grad.mul_(scale) does; s == 1 writes nothing) and, with
// norm, returns the sum of the squares of g before scaling, accumulated in
// float64 (four partial sums, so the loop is not bound by one add chain).
func ScaleF32(g []float32, s float32, norm bool) float64 {
	if !norm {
		if s != 1 {
			for i, x := range g {
				g[i] = x * s
			}
		}
		return 0
	}
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(g); i += 4 {
		x0, x1, x2, x3 := float64(g[i]), float64(g[i+1]), float64(g[i+2]), float64(g[i+3])
		s0 += x0 * x0
		s1 += x1 * x1
		s2 += x2 * x2
		s3 += x3 * x3
		if s != 1 {
			g[i], g[i+1], g[i+2], g[i+3] = g[i]*s, g[i+1]*s, g[i+2]*s, g[i+3]*s
		}
	}
	for ; i < len(g); i++ {
		x := float64(g[i])
		s0 += x * x
		if s != 1 {
			g[i] *= s
		}
	}
	return (s0 + s1) + (s2 + s3)
}

// ScaleBF16 is ScaleF32 for bfloat16 gradients: each element becomes
// bf16(float32(g)*s), as torch's bfloat16 grad.mul_(scale) with a float32
// scale computes in float32 and rounds once.
func ScaleBF16(g []uint16, s float32, norm bool) float64 {
	var s0, s1 float64
	i := 0
	for ; i+2 <= len(g); i += 2 {
		x0, x1 := BF16ToF32(g[i]), BF16ToF32(g[i+1])
		if norm {
			s0 += float64(x0) * float64(x0)
			s1 += float64(x1) * float64(x1)
		}
		if s != 1 {
			g[i], g[i+1] = F32ToBF16(x0*s), F32ToBF16(x1*s)
		}
	}
	for ; i < len(g); i++ {
		x := BF16ToF32(g[i])
		if norm {
			s0 += float64(x) * float64(x)
		}
		if s != 1 {
			g[i] = F32ToBF16(x * s)
		}
	}
	return s0 + s1
}
