package optimizer

import (
	"fmt"
	"math"
	"math/big"
	"sync"
)

// Scalars are the per-step constants of one AdamW update, computed by the
// caller exactly as torch's _single_tensor_adam computes them in Python
// float64 (see ScalarsFor). The kernels round each to the tensor's compute
// type (float32) as torch does when it passes a Python scalar to an op.
type Scalars struct {
	Decay       float64 // 1 - lr*weight_decay (param.mul_)
	ApplyDecay  bool    // weight_decay != 0
	Beta1W      float64 // 1 - beta1 (exp_avg.lerp_ weight)
	Beta2       float64 // exp_avg_sq.mul_(beta2)
	OneMinusB2  float64 // 1 - beta2 (addcmul value)
	NegStepSize float64 // -lr / bias_correction1 (addcdiv value)
	BC2Sqrt     float64 // (1 - beta2**step) ** 0.5
	Eps         float64
	Amsgrad     bool
	Maximize    bool
	// Fused selects torch's fused arithmetic (fused.go) instead of the
	// single-tensor one; Lanes is then the vector width of the client's
	// fused kernel for the dtype (0: a build without vector units).
	Fused bool
	Lanes int
	// LR, Beta1 and WeightDecay are the hyper-parameters themselves, as the
	// client's torch passes them to its fused CUDA kernel (which derives its
	// constants on the device from them, the step count, Beta2 and Eps);
	// only the CUDA engine's fused kernels use them.
	LR, Beta1, WeightDecay float64
	// FusedDouble selects the fused CUDA arithmetic of torch 2.8 to 2.10,
	// which evaluates part of the update in double (fused_cuda.go).
	FusedDouble bool
}

// Hyper are AdamW's hyper-parameters, as torch.optim.AdamW takes them.
type Hyper struct {
	LR          float64
	Beta1       float64
	Beta2       float64
	Eps         float64
	WeightDecay float64
	Amsgrad     bool
	Maximize    bool
}

// Validate rejects hyper-parameters torch.optim.AdamW rejects.
func (h Hyper) Validate() error {
	switch {
	case !(h.LR >= 0) || math.IsInf(h.LR, 0):
		return fmt.Errorf("invalid learning rate: %v", h.LR)
	case !(h.Eps >= 0) || math.IsInf(h.Eps, 0):
		return fmt.Errorf("invalid epsilon value: %v", h.Eps)
	case !(h.Beta1 >= 0 && h.Beta1 < 1):
		return fmt.Errorf("invalid beta parameter at index 0: %v", h.Beta1)
	case !(h.Beta2 >= 0 && h.Beta2 < 1):
		return fmt.Errorf("invalid beta parameter at index 1: %v", h.Beta2)
	case !(h.WeightDecay >= 0) || math.IsInf(h.WeightDecay, 0):
		return fmt.Errorf("invalid weight_decay value: %v", h.WeightDecay)
	}
	return nil
}

// ScalarsFor computes the scalars of step number step (1-based) in Go, for
// Go-native training. beta**step is computed correctly rounded (as glibc's
// pow is in practice; Go's math.Pow can be tens of ulps away), but clients
// that must match torch bit for bit send the Scalars their Python computed.
func ScalarsFor(h Hyper, step int64) Scalars {
	s := int64(float32(step)) // torch keeps step as a float32 tensor
	bc1 := 1 - PowInt(h.Beta1, s)
	bc2 := 1 - PowInt(h.Beta2, s)
	return Scalars{
		Decay:       1 - h.LR*h.WeightDecay,
		ApplyDecay:  h.WeightDecay != 0,
		Beta1W:      1 - h.Beta1,
		Beta2:       h.Beta2,
		OneMinusB2:  1 - h.Beta2,
		NegStepSize: -(h.LR / bc1),
		BC2Sqrt:     math.Sqrt(bc2), // pow(x, 0.5) is the correctly rounded sqrt
		Eps:         h.Eps,
		Amsgrad:     h.Amsgrad,
		Maximize:    h.Maximize,
	}
}

// PowInt returns x**n (n >= 0) correctly rounded to float64, computed by
// repeated squaring in 512-bit binary floating point.
func PowInt(x float64, n int64) float64 {
	if n < 0 {
		return math.NaN()
	}
	const prec = 512
	r := new(big.Float).SetPrec(prec).SetFloat64(1)
	b := new(big.Float).SetPrec(prec).SetFloat64(x)
	for ; n > 0; n >>= 1 {
		if n&1 == 1 {
			r.Mul(r, b)
		}
		b.Mul(b, b)
	}
	f, _ := r.Float64()
	return f
}

// f32 is Scalars rounded to float32, as the kernels use them.
type f32 struct {
	decay, w, b2, omb2, negStep, bc2s, eps float32
}

func (s Scalars) f32() f32 {
	return f32{float32(s.Decay), float32(s.Beta1W), float32(s.Beta2), float32(s.OneMinusB2),
		float32(s.NegStepSize), float32(s.BC2Sqrt), float32(s.Eps)}
}

// block is the number of elements processed per pass with a square root the
// engine computes (the IEEE one, an MKL emulation): a block's data stays in
// L1 between the two passes, so the tensor is still read once. A square root
// that is a call into another library (MKL's vmsSqrt through purego) costs a
// fixed overhead per call, so it gets blocks of callBlock elements, which
// still stay in L2 (measured in docs/benchmarks.md).
const (
	block     = 512
	callBlock = 4096
)

// sqrtScratch holds a block's squared moments and their roots (a Sqrt
// function's arguments escape, so they would be allocated on every call).
var sqrtScratch = sync.Pool{New: func() any { return new([2 * callBlock]float32) }}

// StepF32 applies one AdamW step to float32 tensors, element for element as
// torch.optim.AdamW (single-tensor path) does on CPU:
//
//	param.mul_(1 - lr*wd)
//	exp_avg.lerp_(grad, 1 - beta1)                        # fma(w, g-m, m)
//	exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # fma(value*g, g, v)
//	denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)   # max_exp_avg_sq with amsgrad
//	param.addcdiv_(exp_avg, denom, value=-step_size)      # p + (value*m)/denom
//
// vmax is used only when s.Amsgrad is set. All slices must have len(p).
func StepF32(p, g, m, v, vmax []float32, s Scalars, sqrt Sqrt) {
	k := s.f32()
	n := len(p)
	g, m, v = g[:n], m[:n], v[:n]
	if s.Amsgrad {
		vmax = vmax[:n]
	}
	// One pass in assembly where there is one for this square root; the
	// blocks below do the rest.
	head := stepF32OnePass(p, g, m, v, s, k, sqrt)
	p, g, m, v = p[head:], g[head:], m[head:], v[head:]
	if s.Amsgrad {
		vmax = vmax[head:]
	}
	n -= head
	blk := block
	if sqrt.call != nil {
		blk = callBlock
	}
	scratch := sqrtScratch.Get().(*[2 * callBlock]float32)
	defer sqrtScratch.Put(scratch)
	in, out := scratch[:blk], scratch[callBlock:callBlock+blk]
	for base := 0; base < n; base += blk {
		end := min(base+blk, n)
		pb, gb, mb, vb := p[base:end], g[base:end], m[base:end], v[base:end]
		nb := end - base
		// Pass 1: decay, exp_avg, exp_avg_sq (assembly for the head where available).
		for i := stepF32Vec(pb, gb, mb, vb, in[:nb], s, k); i < nb; i++ {
			gi := gb[i]
			if s.Maximize {
				gi = -gi
			}
			if s.ApplyDecay {
				pb[i] = float32(pb[i] * k.decay)
			}
			mb[i] = Lerp32(mb[i], gi, k.w)
			vi := float32(vb[i] * k.b2)
			vi = FMA32(float32(k.omb2*gi), gi, vi)
			vb[i] = vi
			if s.Amsgrad {
				vi = Max32(vmax[base+i], vi)
				vmax[base+i] = vi
			}
			in[i] = vi
		}
		sqrt.Apply(out[:nb], in[:nb])
		// Pass 2: denom and the parameter update.
		for i := pass2Vec(pb, mb, out[:nb], k); i < nb; i++ {
			den := float32(out[i] / k.bc2s)
			den = float32(den + k.eps)
			pb[i] = float32(pb[i] + float32(float32(k.negStep*mb[i])/den))
		}
	}
}

// StepBF16 is StepF32 for bfloat16 tensors (bit patterns in uint16): each op
// computes in float32 and rounds to bfloat16 once, as torch's CPU kernels do
// for reduced-precision types (whose square root is the IEEE one).
//
// One operand differs: torch's add_ converts its scalar to the tensor's
// dtype, so eps is first rounded to bfloat16 (mul_, div and the add/addc*
// values stay float32).
func StepBF16(p, g, m, v, vmax []uint16, s Scalars) {
	k := s.f32()
	epsBF := BF16ToF32(F32ToBF16(k.eps))
	n := len(p)
	g, m, v = g[:n], m[:n], v[:n]
	if s.Amsgrad {
		vmax = vmax[:n]
	}
	for i := stepBF16Vec(p, g, m, v, s, k, epsBF); i < n; i++ {
		gi := BF16ToF32(g[i])
		if s.Maximize {
			gi = -gi
		}
		pi := BF16ToF32(p[i])
		if s.ApplyDecay {
			pi = BF16ToF32(F32ToBF16(float32(pi * k.decay)))
		}
		mh := F32ToBF16(Lerp32(BF16ToF32(m[i]), gi, k.w))
		vi := BF16ToF32(F32ToBF16(float32(BF16ToF32(v[i]) * k.b2)))
		vh := F32ToBF16(FMA32(float32(k.omb2*gi), gi, vi))
		m[i], v[i] = mh, vh
		vi = BF16ToF32(vh)
		if s.Amsgrad {
			vi = Max32(BF16ToF32(vmax[i]), vi)
			vmax[i] = F32ToBF16(vi)
		}
		den := BF16ToF32(F32ToBF16(Sqrt32(vi)))
		den = BF16ToF32(F32ToBF16(float32(den / k.bc2s)))
		den = BF16ToF32(F32ToBF16(float32(den + epsBF)))
		p[i] = F32ToBF16(float32(pi + float32(float32(k.negStep*BF16ToF32(mh))/den)))
	}
}

// AddF32 accumulates src into dst (dst += src), as autograd accumulates .grad.
func AddF32(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] = float32(dst[i] + src[i])
	}
}

// AddBF16 is AddF32 for bfloat16: the sum is computed in float32 and rounded once.
func AddBF16(dst, src []uint16) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] = F32ToBF16(float32(BF16ToF32(dst[i]) + BF16ToF32(src[i])))
	}
}
