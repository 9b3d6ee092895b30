package optimizer

import "fmt"

// This file is torch's foreach AdamW (_multi_tensor_adam, the default on
// CUDA) in plain Go, a peer of the single-tensor arithmetic in adamw.go as
// torch/optim/adam.py keeps _single_tensor_adam and _multi_tensor_adam side
// by side. Every foreach op computes in float32 and rounds to the tensor's
// dtype once per op (docs/gpu.md lists the ops). The device engine's kernels
// (package optimizer/device) compute exactly this; the GPU check compares
// both with torch.

// ForeachBF16 rounds a float32 to bfloat16 as c10::BFloat16 does on sm_80 and
// newer GPUs (cvt.rn.bf16.f32): nearest-even, NaN as 0x7FFF.
func ForeachBF16(f float32) uint16 {
	if f != f {
		return 0x7FFF
	}
	return F32ToBF16(f)
}

// foreachScalars are the step's Python floats as the foreach ops see them:
// rounded once to float32 (c10::Scalar::to<float>).
type foreachScalars struct {
	decay, w, b2, omb2, negStep, bc2s, eps float32
	s                                      Scalars
}

func foreachOf(sc Scalars) foreachScalars {
	return foreachScalars{float32(sc.Decay), float32(sc.Beta1W), float32(sc.Beta2), float32(sc.OneMinusB2),
		float32(sc.NegStepSize), float32(sc.BC2Sqrt), float32(sc.Eps), sc}
}

// foreachElement is one element of one foreach step; round is the storage
// rounding of the dtype (identity for float32).
func foreachElement(p, g, m, v, vmax float32, k foreachScalars, round func(float32) float32) (float32, float32, float32, float32) {
	if k.s.Maximize {
		g = -g
	}
	if k.s.ApplyDecay {
		p = round(p * k.decay) // _foreach_mul_
	}
	d := g - m // _foreach_lerp_: start + w*(end-start), or end - (end-start)*(1-w)
	if w := k.w; w < 0.5 && w > -0.5 {
		m = round(FMA32(w, d, m))
	} else {
		m = round(FMA32(-d, 1-w, g))
	}
	v = round(v * k.b2) // _foreach_mul_ then _foreach_addcmul_
	if k.omb2 == 1 {
		v = round(FMA32(g, g, v))
	} else {
		v = round(FMA32(k.omb2, g*g, v))
	}
	src := v
	if k.s.Amsgrad {
		if !(vmax != vmax || vmax > v) { // _foreach_maximum_ propagates NaN
			vmax = v
		}
		src = vmax
	}
	den := round(Sqrt32(src)) // _foreach_sqrt, _foreach_div_, _foreach_add_
	den = round(den / k.bc2s)
	den = round(den + k.eps)
	q := m / den // _foreach_addcdiv_
	if k.negStep == 1 {
		p = round(p + q)
	} else {
		p = round(FMA32(k.negStep, q, p))
	}
	return p, m, v, vmax
}

func noRound(f float32) float32 { return f }

func foreachRoundBF16(f float32) float32 { return BF16ToF32(ForeachBF16(f)) }

// ForeachStepF32 applies one foreach AdamW step to float32 slices (vmax is
// used with amsgrad only).
func ForeachStepF32(p, g, m, v, vmax []float32, sc Scalars) {
	k := foreachOf(sc)
	for i := range p {
		var vm float32
		if sc.Amsgrad {
			vm = vmax[i]
		}
		p[i], m[i], v[i], vm = foreachElement(p[i], g[i], m[i], v[i], vm, k, noRound)
		if sc.Amsgrad {
			vmax[i] = vm
		}
	}
}

// ForeachStepBF16 is ForeachStepF32 for bfloat16 bit patterns.
func ForeachStepBF16(p, g, m, v, vmax []uint16, sc Scalars) {
	k := foreachOf(sc)
	f := BF16ToF32
	for i := range p {
		var vm float32
		if sc.Amsgrad {
			vm = f(vmax[i])
		}
		pp, mm, vv, vm := foreachElement(f(p[i]), f(g[i]), f(m[i]), f(v[i]), vm, k, foreachRoundBF16)
		p[i], m[i], v[i] = ForeachBF16(pp), ForeachBF16(mm), ForeachBF16(vv)
		if sc.Amsgrad {
			vmax[i] = ForeachBF16(vm)
		}
	}
}

// ForeachStep applies ForeachStepF32 or ForeachStepBF16 to byte buffers of
// dtype dt (4- or 2-byte aligned, as engine and shared-memory buffers are).
func ForeachStep(dt DType, p, g, m, v, vmax []byte, sc Scalars) error {
	switch dt {
	case Float32:
		ForeachStepF32(f32s(p), f32s(g), f32s(m), f32s(v), f32s(vmax), sc)
	case BFloat16:
		ForeachStepBF16(u16s(p), u16s(g), u16s(m), u16s(v), u16s(vmax), sc)
	default:
		return fmt.Errorf("foreach step: dtype %v not supported", dt)
	}
	return nil
}

// ForeachAdd is the accumulation of one micro-batch gradient as the device
// engine computes it: dst += src, rounded to the dtype.
func ForeachAdd(dt DType, dst, src []byte) error {
	switch dt {
	case Float32:
		d, s := f32s(dst), f32s(src)
		for i := range d {
			d[i] += s[i]
		}
	case BFloat16:
		d, s := u16s(dst), u16s(src)
		for i := range d {
			d[i] = ForeachBF16(BF16ToF32(d[i]) + BF16ToF32(s[i]))
		}
	default:
		return fmt.Errorf("foreach add: dtype %v not supported", dt)
	}
	return nil
}
