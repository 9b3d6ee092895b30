package optimizer

import "math"

// This file is torch's fused CPU AdamW (torch.optim.AdamW(fused=True),
// aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAMW mode), the third peer
// beside the single-tensor (adamw.go) and foreach (foreach.go) arithmetic,
// in the evaluation order of the compiled kernel that docs/fused-adamw-cpu.md
// records. Every quantity is computed in float32 and rounded once, when it
// is stored (bfloat16 too: one rounding per element and buffer). The kernel
// of an AVX2 (or AVX-512) build contracts some operations into fused
// multiply-adds, differently in its vector loop and in the scalar tail (the
// last numel % lanes elements of the tensor); a build without vector units
// contracts nothing. Scalars.Lanes says which: the vector width of the
// client's kernel for the dtype, or 0 for the plain build.

// fusedScalars are the step's constants as the fused kernel holds them: each
// computed in double by the client and cast to float once.
type fusedScalars struct {
	decay, w, wm1, b2, c, negStep, bc2s, eps float32
	small, applyDecay, amsgrad, maximize     bool
	fma                                      bool
}

func fusedOf(s Scalars) fusedScalars {
	w := float32(s.Beta1W)
	return fusedScalars{decay: float32(s.Decay), w: w, wm1: w - 1, b2: float32(s.Beta2), c: float32(s.OneMinusB2),
		negStep: float32(s.NegStepSize), bc2s: float32(s.BC2Sqrt), eps: float32(s.Eps),
		small: w < 0.5 && w > -0.5, applyDecay: s.ApplyDecay, amsgrad: s.Amsgrad, maximize: s.Maximize, fma: s.Lanes > 0}
}

// fusedElement is one element of one fused step in float32: tail says
// whether it is in the scalar tail of an FMA build. It returns the new
// param, exp_avg, exp_avg_sq and max_exp_avg_sq, unrounded to the storage
// type.
//
// Every product is converted to float32 explicitly: Go may otherwise fuse
// x*y + z into one FMA (GOAMD64=v3), which the kernel's order does not do
// there.
func fusedElement(p, g, m, v, vmax float32, k fusedScalars, tail bool) (float32, float32, float32, float32) {
	if k.maximize {
		g = -g
	}
	if k.applyDecay {
		p = float32(p * k.decay)
	}
	d := g - m
	switch {
	case !k.fma && k.small:
		m = float32(d*k.w) + m
	case !k.fma:
		m = float32(d*k.wm1) + g
	case k.small:
		m = FMA32(k.w, d, m)
	case tail: // g - (g-m)*(1-w), one rounding
		m = FMA32(-d, 1-k.w, g)
	default:
		m = FMA32(k.wm1, d, g)
	}
	cg := float32(k.c * g)
	switch {
	case !k.fma:
		v = float32(v*k.b2) + float32(cg*g)
	case tail:
		v = FMA32(v, k.b2, float32(cg*g))
	default:
		v = FMA32(g, cg, float32(k.b2*v))
	}
	x := v
	if k.amsgrad {
		vmax = Max32(vmax, v)
		x = vmax
	}
	den := float32(Sqrt32(x)/k.bc2s) + k.eps
	p = float32(float32(k.negStep*m)/den) + p
	return p, m, v, vmax
}

// FusedStepF32 applies one fused AdamW step to float32 slices that are
// elements [off, off+len(p)) of a tensor of numel elements (the tail is
// decided by the element's place in the whole tensor).
func FusedStepF32(p, g, m, v, vmax []float32, s Scalars, off, numel int) {
	k := fusedOf(s)
	tail := fusedTail(numel, s.Lanes)
	start := 0
	if k.fma && !k.amsgrad {
		// Vector-loop elements: assembly where the CPU has it (fusedF32Vec
		// does a multiple of 8), then, in the common case (beta1 > 0.5, no
		// maximize), a Go loop the compiler keeps tight.
		vec := max(0, min(len(p), tail-off))
		start = fusedF32Vec(p[:vec], g, m, v, k)
		if k.small && !k.maximize {
			fusedF32Vector(p[start:vec], g[start:vec], m[start:vec], v[start:vec], k)
			start = vec
		}
	}
	for i := start; i < len(p); i++ {
		var vm float32
		if k.amsgrad {
			vm = vmax[i]
		}
		p[i], m[i], v[i], vm = fusedElement(p[i], g[i], m[i], v[i], vm, k, off+i >= tail)
		if k.amsgrad {
			vmax[i] = vm
		}
	}
}

// fusedF32Vector is fusedElement for vector-loop elements of an FMA build
// with beta1 > 0.5, no amsgrad and no maximize, written out so that it
// inlines: fma32 takes the exact fast path of FMA32 and calls it only for the
// rare double-rounding midpoints.
func fusedF32Vector(p, g, m, v []float32, k fusedScalars) {
	decay := float32(1)
	if k.applyDecay {
		decay = k.decay
	}
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)]
	for i := range p {
		gi, mi := g[i], m[i]
		pd := float32(p[i] * decay)
		mi = fma32(k.w, float32(gi-mi), mi)
		cg := float32(k.c * gi)
		vi := fma32(gi, cg, float32(k.b2*v[i]))
		den := float32(Sqrt32(vi)/k.bc2s) + k.eps
		p[i] = float32(float32(k.negStep*mi)/den) + pd
		m[i], v[i] = mi, vi
	}
}

// fma32 is FMA32's exact fast path (the product of two float32 is exact in
// float64, so the float64 sum has one rounding; rounding it to float32 is
// exact unless it lies on a float32 midpoint), small enough to inline.
func fma32(a, b, c float32) float32 {
	s := float64(a)*float64(b) + float64(c)
	if bits := math.Float64bits(s); bits&(1<<29-1) == 1<<28 || (bits>>52)&0x7FF < 1023-126 {
		return FMA32(a, b, c)
	}
	return float32(s)
}

// FusedStepBF16 is FusedStepF32 for bfloat16 bit patterns: computed in
// float32 from the widened inputs, each buffer rounded once when stored.
func FusedStepBF16(p, g, m, v, vmax []uint16, s Scalars, off, numel int) {
	k := fusedOf(s)
	tail := fusedTail(numel, s.Lanes)
	start := 0
	if k.fma && !k.amsgrad {
		start = fusedBF16Vec(p[:max(0, min(len(p), tail-off))], g, m, v, k)
	}
	for i := start; i < len(p); i++ {
		var vm float32
		if k.amsgrad {
			vm = BF16ToF32(vmax[i])
		}
		pp, mm, vv, vm := fusedElement(BF16ToF32(p[i]), BF16ToF32(g[i]), BF16ToF32(m[i]), BF16ToF32(v[i]), vm, k,
			off+i >= tail)
		round := F32ToBF16
		if k.fma && off+i < tail {
			round = f32ToBF16Vec
		}
		p[i], m[i], v[i] = round(pp), round(mm), round(vv)
		if k.amsgrad {
			vmax[i] = round(vm)
		}
	}
}

// f32ToBF16Vec is F32ToBF16 as the vectorized conversion of a torch build
// with vector units does it: the same rounding, but every NaN becomes 0xFFFF
// (the scalar conversion makes it 0x7FC0).
func f32ToBF16Vec(f float32) uint16 {
	if f != f {
		return 0xFFFF
	}
	return F32ToBF16(f)
}

// fusedTail is the index of the first element the kernel's scalar tail
// updates: the tensor's last numel % lanes elements (none without lanes).
func fusedTail(numel, lanes int) int {
	if lanes <= 0 {
		return numel
	}
	return numel - numel%lanes
}
