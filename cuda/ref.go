package cuda

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/sonar-moe/sonar/optimizer"
)

// This file is the arithmetic of kernels/adamw.cu in Go: the reference the
// GPU check compares the kernels with (bit for bit) next to torch. It is not
// used to train; optimizer.StepF32/StepBF16 reproduce torch's CPU path, which
// rounds differently (see docs/gpu.md).

// RefBF16 rounds a float32 to bfloat16 as c10::BFloat16 does on sm_80 and
// newer GPUs (cvt.rn.bf16.f32): nearest-even, NaN as 0x7FFF.
func RefBF16(f float32) uint16 {
	if f != f {
		return 0x7FFF
	}
	return optimizer.F32ToBF16(f)
}

type refScalars struct {
	decay, w, b2, omb2, negStep, bc2s, eps float32
	flags                                  uint32
}

func refScalarsOf(sc optimizer.Scalars) refScalars {
	return refScalars{float32(sc.Decay), float32(sc.Beta1W), float32(sc.Beta2), float32(sc.OneMinusB2),
		float32(sc.NegStepSize), float32(sc.BC2Sqrt), float32(sc.Eps), scalarFlags(sc)}
}

// refElement mirrors sonar_adamw_element; round is the storage rounding.
func refElement(p, g, m, v, vmax float32, k refScalars, round func(float32) float32) (float32, float32, float32, float32) {
	if k.flags&flagMaximize != 0 {
		g = -g
	}
	if k.flags&flagDecay != 0 {
		p = round(p * k.decay)
	}
	d := g - m
	if w := k.w; w < 0.5 && w > -0.5 {
		m = round(optimizer.FMA32(w, d, m))
	} else {
		m = round(optimizer.FMA32(-d, 1-w, g))
	}
	v = round(v * k.b2)
	if k.omb2 == 1 {
		v = round(optimizer.FMA32(g, g, v))
	} else {
		v = round(optimizer.FMA32(k.omb2, g*g, v))
	}
	src := v
	if k.flags&flagAmsgrad != 0 {
		if !(vmax != vmax || vmax > v) {
			vmax = v
		}
		src = vmax
	}
	den := round(optimizer.Sqrt32(src))
	den = round(den / k.bc2s)
	den = round(den + k.eps)
	q := m / den
	if k.negStep == 1 {
		p = round(p + q)
	} else {
		p = round(optimizer.FMA32(k.negStep, q, p))
	}
	return p, m, v, vmax
}

func identity(f float32) float32 { return f }
func roundBF16(f float32) float32 {
	return optimizer.BF16ToF32(RefBF16(f))
}

// RefStepF32 applies what sonar_adamw_f32 computes to host slices (vmax is
// used with amsgrad only).
func RefStepF32(p, g, m, v, vmax []float32, sc optimizer.Scalars) {
	k := refScalarsOf(sc)
	for i := range p {
		var vm float32
		if sc.Amsgrad {
			vm = vmax[i]
		}
		p[i], m[i], v[i], vm = refElement(p[i], g[i], m[i], v[i], vm, k, identity)
		if sc.Amsgrad {
			vmax[i] = vm
		}
	}
}

// RefStepBF16 is RefStepF32 for bfloat16 bit patterns (sonar_adamw_bf16).
func RefStepBF16(p, g, m, v, vmax []uint16, sc optimizer.Scalars) {
	k := refScalarsOf(sc)
	f := optimizer.BF16ToF32
	for i := range p {
		var vm float32
		if sc.Amsgrad {
			vm = f(vmax[i])
		}
		pp, mm, vv, vm := refElement(f(p[i]), f(g[i]), f(m[i]), f(v[i]), vm, k, roundBF16)
		p[i], m[i], v[i] = RefBF16(pp), RefBF16(mm), RefBF16(vv)
		if sc.Amsgrad {
			vmax[i] = RefBF16(vm)
		}
	}
}

// RefStep applies RefStepF32 or RefStepBF16 to little-endian byte buffers.
func RefStep(dt optimizer.DType, p, g, m, v, vmax []byte, sc optimizer.Scalars) error {
	switch dt {
	case optimizer.Float32:
		P, M, V, VM := f32s(p), f32s(m), f32s(v), f32s(vmax)
		RefStepF32(P, f32s(g), M, V, VM, sc)
		putF32s(p, P)
		putF32s(m, M)
		putF32s(v, V)
		putF32s(vmax, VM)
	case optimizer.BFloat16:
		P, M, V, VM := u16s(p), u16s(m), u16s(v), u16s(vmax)
		RefStepBF16(P, u16s(g), M, V, VM, sc)
		putU16s(p, P)
		putU16s(m, M)
		putU16s(v, V)
		putU16s(vmax, VM)
	default:
		return fmt.Errorf("cuda: dtype %v not supported", dt)
	}
	return nil
}

// RefAdd is sonar_add_*: dst += src rounded to the dtype.
func RefAdd(dt optimizer.DType, dst, src []byte) error {
	switch dt {
	case optimizer.Float32:
		d, s := f32s(dst), f32s(src)
		for i := range d {
			d[i] += s[i]
		}
		putF32s(dst, d)
	case optimizer.BFloat16:
		d, s := u16s(dst), u16s(src)
		for i := range d {
			d[i] = RefBF16(optimizer.BF16ToF32(d[i]) + optimizer.BF16ToF32(s[i]))
		}
		putU16s(dst, d)
	default:
		return fmt.Errorf("cuda: dtype %v not supported", dt)
	}
	return nil
}

// f32s, u16s decode little-endian bytes; putF32s, putU16s encode them back.
func f32s(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func putF32s(b []byte, v []float32) {
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
}

func u16s(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

func putU16s(b []byte, v []uint16) {
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], x)
	}
}
