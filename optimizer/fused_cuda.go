package optimizer

import (
	"fmt"
	"math"
)

// This file is torch's fused CUDA AdamW (torch.optim.AdamW(fused=True) on a
// GPU: aten/src/ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode, as built
// in torch 2.11), the reference of the device engine's sonar_fused_adamw
// kernels (package optimizer/device). Everything is float32 ("opmath"): the
// hyper-parameters are cast to float once, the bias corrections are
// 1 - powf(beta, step) in float, and each stored value is rounded to the
// tensor's dtype once (bfloat16: one rounding per buffer, the float values
// feed the rest of the step). docs/gpu.md records where each rounding and
// fused multiply-add comes from.

// FusedCUDA are the float constants of one fused CUDA step of one tensor.
type FusedCUDA struct {
	LR, Beta1, Beta2, WeightDecay, Eps float32
	// BC1 and BC2 are 1 - powf(beta1, step) and 1 - powf(beta2, step) as
	// the device computes them (CUDA's powf, not correctly rounded in
	// general); FusedCUDAOf uses a correctly rounded powf instead.
	BC1, BC2          float32
	Amsgrad, Maximize bool
}

// FusedCUDAOf are the constants of step `step` (the count after the update)
// from the scalars a client sends for a fused step (LR, Beta1, WeightDecay,
// Beta2, Eps), with host-computed bias corrections (see FusedCUDA.BC1).
func FusedCUDAOf(sc Scalars, step int64) FusedCUDA {
	k := FusedCUDA{LR: float32(sc.LR), Beta1: float32(sc.Beta1), Beta2: float32(sc.Beta2),
		WeightDecay: float32(sc.WeightDecay), Eps: float32(sc.Eps), Amsgrad: sc.Amsgrad, Maximize: sc.Maximize}
	s := float32(step) // torch's state_step is a float32 tensor
	k.BC1 = 1 - Powf(k.Beta1, s)
	k.BC2 = 1 - Powf(k.Beta2, s)
	return k
}

// Powf is the correctly rounded float32 x**y (through float64, whose pow is
// accurate to well under an ulp of float32; a result within 2^-29 relative
// of a float32 rounding boundary could still round the wrong way).
func Powf(x, y float32) float32 { return float32(math.Pow(float64(x), float64(y))) }

// fusedCUDAConsts are the per-tensor constants the kernel derives.
type fusedCUDAConsts struct {
	lrwd, b1, b2, eps, stepSize, bc2s float32
	decay, amsgrad, maximize          bool
}

func (k FusedCUDA) consts() fusedCUDAConsts {
	return fusedCUDAConsts{lrwd: float32(k.LR * k.WeightDecay), b1: k.Beta1, b2: k.Beta2, eps: k.Eps,
		stepSize: k.LR / k.BC1, bc2s: Sqrt32(k.BC2),
		decay: k.WeightDecay != 0, amsgrad: k.Amsgrad, maximize: k.Maximize}
}

// fusedCUDAElement is one element in float32, unrounded to the storage type.
// Products are converted to float32 explicitly so that Go cannot fuse them
// into an add the kernel keeps apart.
func fusedCUDAElement(p, g, m, v, vmax float32, c fusedCUDAConsts) (float32, float32, float32, float32) {
	if c.maximize {
		g = -g
	}
	if c.decay { // param -= lr*weight_decay*param, contracted by nvcc
		p = FMA32(-c.lrwd, p, p)
	}
	m = FMA32(c.b1, m, FMA32(-c.b1, g, g))
	gg := float32(g * g)
	v = FMA32(c.b2, v, FMA32(-c.b2, gg, gg))
	x := v
	if c.amsgrad { // std::max(vmax, v)
		if vmax < v {
			vmax = v
		}
		x = vmax
	}
	den := float32(Sqrt32(x)/c.bc2s) + c.eps
	p -= float32(float32(c.stepSize*m) / den)
	return p, m, v, vmax
}

// FusedCUDAStepF32 applies one fused CUDA step to float32 slices (vmax with
// amsgrad only).
func FusedCUDAStepF32(p, g, m, v, vmax []float32, k FusedCUDA) {
	c := k.consts()
	for i := range p {
		var vm float32
		if k.Amsgrad {
			vm = vmax[i]
		}
		p[i], m[i], v[i], vm = fusedCUDAElement(p[i], g[i], m[i], v[i], vm, c)
		if k.Amsgrad {
			vmax[i] = vm
		}
	}
}

// FusedCUDAStepBF16 is FusedCUDAStepF32 for bfloat16 bit patterns: float32
// arithmetic on the widened values, each buffer rounded once when stored
// (cvt.rn.bf16.f32: nearest-even, NaN as 0x7FFF).
func FusedCUDAStepBF16(p, g, m, v, vmax []uint16, k FusedCUDA) {
	c := k.consts()
	f := BF16ToF32
	for i := range p {
		var vm float32
		if k.Amsgrad {
			vm = f(vmax[i])
		}
		pp, mm, vv, vm := fusedCUDAElement(f(p[i]), f(g[i]), f(m[i]), f(v[i]), vm, c)
		p[i], m[i], v[i] = ForeachBF16(pp), ForeachBF16(mm), ForeachBF16(vv)
		if k.Amsgrad {
			vmax[i] = ForeachBF16(vm)
		}
	}
}

// FusedCUDAStep applies FusedCUDAStepF32 or FusedCUDAStepBF16 to byte
// buffers of dtype dt.
func FusedCUDAStep(dt DType, p, g, m, v, vmax []byte, k FusedCUDA) error {
	switch dt {
	case Float32:
		FusedCUDAStepF32(f32s(p), f32s(g), f32s(m), f32s(v), f32s(vmax), k)
	case BFloat16:
		FusedCUDAStepBF16(u16s(p), u16s(g), u16s(m), u16s(v), u16s(vmax), k)
	default:
		return fmt.Errorf("fused CUDA step: dtype %v not supported", dt)
	}
	return nil
}

// FusedCUDA64 are the constants of one step of torch 2.8 to 2.10's fused
// CUDA AdamW (the device engine's sonar_fused64 kernels), which takes the
// hyper-parameters as doubles and evaluates the decay and both moving
// averages in double, each result rounded to float where torch's source
// assigns it to a float (docs/gpu.md).
type FusedCUDA64 struct {
	LR, Beta1, Beta2, WeightDecay, Eps float64
	// BC1 and BC2 are 1 - pow(beta, step) in double as the device computes
	// them (CUDA's pow); FusedCUDA64Of uses a correctly rounded pow.
	BC1, BC2          float64
	Amsgrad, Maximize bool
}

// FusedCUDA64Of are the constants of step `step` (the count after the
// update) from a fused step's scalars, with host-computed bias corrections.
func FusedCUDA64Of(sc Scalars, step int64) FusedCUDA64 {
	s := int64(float32(step)) // torch's float32 state_step, read as double
	return FusedCUDA64{LR: sc.LR, Beta1: sc.Beta1, Beta2: sc.Beta2, WeightDecay: sc.WeightDecay, Eps: sc.Eps,
		BC1: 1 - PowInt(sc.Beta1, s), BC2: 1 - PowInt(sc.Beta2, s), Amsgrad: sc.Amsgrad, Maximize: sc.Maximize}
}

type fusedCUDA64Consts struct {
	lrwd, b1, omb1, b2, omb2, eps float64
	stepSize, bc2s                float32
	decay, amsgrad, maximize      bool
}

func (k FusedCUDA64) consts() fusedCUDA64Consts {
	return fusedCUDA64Consts{lrwd: k.LR * k.WeightDecay, b1: k.Beta1, omb1: 1 - k.Beta1, b2: k.Beta2, omb2: 1 - k.Beta2,
		eps: k.Eps, stepSize: float32(k.LR / float64(float32(k.BC1))), bc2s: float32(math.Sqrt(k.BC2)),
		decay: k.WeightDecay != 0, amsgrad: k.Amsgrad, maximize: k.Maximize}
}

// fusedCUDA64Element is one element; float64(...) conversions keep Go from
// fusing products into sums the kernel rounds apart.
func fusedCUDA64Element(p, g, m, v, vmax float32, c fusedCUDA64Consts) (float32, float32, float32, float32) {
	if c.maximize {
		g = -g
	}
	gd := float64(g)
	if c.decay { // param -= lr*weight_decay*param, in double, contracted by nvcc
		p = float32(math.FMA(-c.lrwd, float64(p), float64(p)))
	}
	m = float32(math.FMA(float64(m), c.b1, float64(gd*c.omb1)))
	v = float32(math.FMA(float64(v), c.b2, float64(gd*float64(gd*c.omb2))))
	x := v
	if c.amsgrad {
		if vmax < v {
			vmax = v
		}
		x = vmax
	}
	den := float32(float64(float32(Sqrt32(x)/c.bc2s)) + c.eps)
	p -= float32(float32(c.stepSize*m) / den)
	return p, m, v, vmax
}

// FusedCUDA64Step applies one step of that arithmetic to byte buffers of
// dtype dt (bfloat16: each buffer rounded once when stored).
func FusedCUDA64Step(dt DType, p, g, m, v, vmax []byte, k FusedCUDA64) error {
	c := k.consts()
	switch dt {
	case Float32:
		P, G, M, V, VM := f32s(p), f32s(g), f32s(m), f32s(v), f32s(vmax)
		for i := range P {
			var vm float32
			if k.Amsgrad {
				vm = VM[i]
			}
			P[i], M[i], V[i], vm = fusedCUDA64Element(P[i], G[i], M[i], V[i], vm, c)
			if k.Amsgrad {
				VM[i] = vm
			}
		}
	case BFloat16:
		P, G, M, V, VM := u16s(p), u16s(g), u16s(m), u16s(v), u16s(vmax)
		f := BF16ToF32
		for i := range P {
			var vm float32
			if k.Amsgrad {
				vm = f(VM[i])
			}
			pp, mm, vv, vm := fusedCUDA64Element(f(P[i]), f(G[i]), f(M[i]), f(V[i]), vm, c)
			P[i], M[i], V[i] = ForeachBF16(pp), ForeachBF16(mm), ForeachBF16(vv)
			if k.Amsgrad {
				VM[i] = ForeachBF16(vm)
			}
		}
	default:
		return fmt.Errorf("fused CUDA step: dtype %v not supported", dt)
	}
	return nil
}
