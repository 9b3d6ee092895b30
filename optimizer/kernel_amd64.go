package optimizer

import (
	"math"
	"unsafe"

	"golang.org/x/sys/cpu"
)

// detectISA: AVX-512 with BF16 (and BW, DQ) and VBMI, without VBMI,
// AVX-512 Foundation where the CPU and the operating system have it
// (x/sys/cpu checks both), AVX2 with FMA, else the Go code.
func detectISA() ISA {
	bf16 := cpu.X86.HasAVX512F && cpu.X86.HasAVX512BF16 && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512DQ
	switch {
	case !cpu.X86.HasAVX2 || !cpu.X86.HasFMA:
		return ISAGo
	case bf16 && cpu.X86.HasAVX512VBMI:
		return ISAAVX512VBMI
	case bf16:
		return ISAAVX512BF16
	case cpu.X86.HasAVX512F:
		return ISAAVX512
	}
	return ISAAVX2
}

// lanes splits the head of an n-element block between the assembly levels:
// wide elements (a multiple of 16) for AVX-512, then narrow ones (a multiple
// of 8) for AVX2; the caller's Go code does the rest.
func lanes(n int) (wide, narrow int) {
	if vecISA >= ISAAVX512 {
		wide = n &^ 15
	}
	if vecISA >= ISAAVX2 {
		narrow = (n - wide) &^ 7
	}
	return wide, narrow
}

type pass1Consts struct {
	decay, c, b2, omb2 float32
	sign, baseMask     uint32
}

// The assembly reads vecConsts at fixed offsets.
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.pass1Consts)-128]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.bc2s)-152]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.negStep)-160]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.wide)-164]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.lsb)-484]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.inf)-548]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.rbc2s)-580]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.bf16Table)-612]
var _ = [1]struct{}{}[unsafe.Offsetof(vecConsts{}.bf16Table)+unsafe.Offsetof(bf16Table{}.bias)-868]

//go:noescape
func pass1AVX2(pp, gg, mm, vv, out *float32, n int, k *pass1Consts)

//go:noescape
func pass2AVX2(pp, mm, sq *float32, n int, k *vecConsts)

//go:noescape
func sqrtAVX(dst, src *float32, n int)

//go:noescape
func pass1AVX512(pp, gg, mm, vv, out *float32, n int, k *pass1Consts)

//go:noescape
func pass2AVX512(pp, mm, sq *float32, n int, k *vecConsts)

//go:noescape
func sqrtAVX512(dst, src *float32, n int)

// stepF32Vec runs the vectorizable head of one block (a multiple of 8
// elements) in assembly and returns how many elements it did; the caller
// finishes the rest with the scalar code.
func stepF32Vec(p, g, m, v, out []float32, s Scalars, k f32) int {
	w, n := lanes(len(p))
	if w+n == 0 || s.Amsgrad {
		return 0
	}
	c1 := newPass1Consts(s, k)
	if w > 0 {
		pass1AVX512(&p[0], &g[0], &m[0], &v[0], &out[0], w, &c1)
	}
	if n > 0 {
		pass1AVX2(&p[w], &g[w], &m[w], &v[w], &out[w], n, &c1)
	}
	return w + n
}

// newPass1Consts packs the decay, lerp and exp_avg_sq constants: with
// |w| < 0.5 lerp is fma(w, g-m, m), otherwise fma(w-1, g-m, g); maximize
// flips the gradient's sign bit; no decay multiplies by exactly 1.
func newPass1Consts(s Scalars, k f32) pass1Consts {
	return lerpConsts(k.decay, k.w, k.b2, k.omb2, s.ApplyDecay, s.Maximize)
}

// lerpConsts is newPass1Consts from the float32 constants themselves (the
// fused kernels' come from fusedScalars).
func lerpConsts(decay, w, b2, omb2 float32, applyDecay, maximize bool) pass1Consts {
	c := pass1Consts{decay: 1, c: w, b2: b2, omb2: omb2}
	if applyDecay {
		c.decay = decay
	}
	if maximize {
		c.sign = 0x80000000
	}
	if !(w < 0.5 && w > -0.5) {
		c.c = w - 1
		c.baseMask = math.MaxUint32
	}
	return c
}

func pass2Vec(p, m, sq []float32, k f32) int {
	w, n := lanes(len(p))
	if w+n == 0 || !divisorOK(k.bc2s) {
		return 0
	}
	c2 := vecConsts{bc2s: k.bc2s, eps: k.eps, negStep: k.negStep}
	c2.setDivide()
	if w > 0 {
		pass2AVX512(&p[0], &m[0], &sq[0], w, &c2)
	}
	if n > 0 {
		pass2AVX2(&p[w], &m[w], &sq[w], n, &c2)
	}
	return w + n
}

func sqrtVec(dst, src []float32) int {
	w, n := lanes(len(src))
	if w > 0 {
		sqrtAVX512(&dst[0], &src[0], w)
	}
	if n > 0 {
		sqrtAVX(&dst[w], &src[w], n)
	}
	return w + n
}

//go:noescape
func mklSqrtAVX2(dst, src *float32, n int, fma bool)

//go:noescape
func mklSqrtAVX512(dst, src *float32, n int)

//go:noescape
func stepF32MKLAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)

//go:noescape
func stepF32IEEEAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)

// divBCAVX2 and divBCAVX512 divide src by k.bc2s into dst the way the
// kernels do (divide_amd64.h), for TestDivideByRecip; n a multiple of 8
// (16).
//
//go:noescape
func divBCAVX2(dst, src *float32, n int, k *vecConsts)

//go:noescape
func divBCAVX512(dst, src *float32, n int, k *vecConsts)

//go:noescape
func stepF32IEEEAVX2(pp, gg, mm, vv *float32, n int, k *vecConsts)

//go:noescape
func stepF32MKLAVX2(pp, gg, mm, vv *float32, n int, k *vecConsts, fma bool)

// mklSqrtSSEAVX512 and stepF32MKLSSEAVX512 are mklSqrtAVX2 and
// stepF32MKLAVX2 on 16 lanes (kernel_avx512_amd64.s), bit for bit; n a
// multiple of 16.
//
//go:noescape
func mklSqrtSSEAVX512(dst, src *float32, n int, fma bool)

//go:noescape
func stepF32MKLSSEAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts, fma bool)

// hasMKLSqrt: the MKL emulations are AVX2+FMA assembly whatever level the
// kernels use (it is the definition of the function, not a faster path);
// where the kernels run AVX-512 they take 16 lanes at a time.
func hasMKLSqrt() bool { return cpuISA >= ISAAVX2 }

// hasMKLSqrtAVX512: the emulation of MKL's AVX-512 kernel needs AVX-512F
// (VRSQRT14PS), whatever level the kernels use.
func hasMKLSqrtAVX512() bool { return cpuISA >= ISAAVX512 }

// mklSqrtVec computes MKL kernel k's square root for the head of src (a
// multiple of 8, or of 16 for the AVX-512 kernel) and returns how many
// elements it did.
func mklSqrtVec(k mklKernel, dst, src []float32) int {
	if k == mklAVX512 {
		n := len(src) &^ 15
		if n == 0 || !hasMKLSqrtAVX512() {
			return 0
		}
		_ = dst[n-1]
		mklSqrtAVX512(&dst[0], &src[0], n)
		return n
	}
	n := len(src) &^ 7
	if n == 0 || !hasMKLSqrt() {
		return 0
	}
	_ = dst[n-1]
	w, _ := lanes(n)
	if w > 0 {
		mklSqrtSSEAVX512(&dst[0], &src[0], w, k == mklFMA)
	}
	if w < n {
		mklSqrtAVX2(&dst[w], &src[w], n-w, k == mklFMA)
	}
	return n
}

// stepF32OnePass runs the head of a float32 single-tensor step (a multiple
// of 8 elements, 16 for MKL's AVX-512 kernel) in one pass where the kernels
// run on AVX2 or wider and the square root is the IEEE one or an MKL
// emulation, and returns how many elements it did (0 otherwise, and with
// amsgrad). The IEEE square root runs 16 lanes at a time on AVX-512 and 8
// (the rest) on AVX2; so do the emulations of MKL's SSE and AVX2 kernels
// (their 16-lane form takes VRSQRTPS on each half: the same bits), while
// the emulation of MKL's AVX-512 kernel is AVX-512 only.
func stepF32OnePass(p, g, m, v []float32, s Scalars, k f32, sqrt Sqrt) int {
	n := len(p) &^ 7
	if sqrt.mkl == mklAVX512 {
		n = len(p) &^ 15
	}
	if n == 0 || s.Amsgrad || vecISA < ISAAVX2 {
		return 0
	}
	c := vecConsts{pass1Consts: newPass1Consts(s, k), bc2s: k.bc2s, eps: k.eps, negStep: k.negStep}
	c.setWide()
	switch {
	case sqrt.mkl == mklAVX512:
		stepF32MKLAVX512(&p[0], &g[0], &m[0], &v[0], n, &c)
	case sqrt.IsMKLEmulation():
		w, _ := lanes(n)
		if w > 0 {
			stepF32MKLSSEAVX512(&p[0], &g[0], &m[0], &v[0], w, &c, sqrt.mkl == mklFMA)
		}
		if w < n {
			stepF32MKLAVX2(&p[w], &g[w], &m[w], &v[w], n-w, &c, sqrt.mkl == mklFMA)
		}
	case sqrt.IsIEEE() && divisorOK(k.bc2s): // the IEEE kernels divide by bc2s through its reciprocal
		w, _ := lanes(n)
		if w > 0 {
			stepF32IEEEAVX512(&p[0], &g[0], &m[0], &v[0], w, &c)
		}
		if w < n {
			stepF32IEEEAVX2(&p[w], &g[w], &m[w], &v[w], n-w, &c)
		}
	default:
		return 0
	}
	return n
}

// vecConsts is read by the step kernels (kernel_*amd64.s) at fixed offsets:
// keep the layout.
type vecConsts struct {
	one, r7fff, hiMask, nan [8]uint32 // 0, 32, 64, 96
	pass1Consts                       // 128: decay, c, b2, omb2, sign (144), baseMask (148)
	bc2s, eps, negStep      float32   // 152, 156, 160
	// wide holds the nine scalars from 128 to 160 (decay ... negStep)
	// broadcast to 8 lanes, then ^baseMask: memory operands for the kernel
	// that needs every register for data (fusedBF16AVX2). 164 + 32*i.
	wide [10][8]uint32
	// lsb, abs and inf are the masks of the bfloat16 rounding in integer
	// operations only (RNDBFOR): 0x10000, 0x7FFFFFFF, 0x7F800000. 484, 516, 548.
	lsb, abs, inf [8]uint32
	// rbc2s is RN(1/bc2s), the reciprocal the kernels divide by bc2s with
	// (divide_amd64.h). 580.
	rbc2s [8]float32
	// bf16Table is the step's table of the rounded square root divided by
	// bc2s (bf16table.go): its 256 bytes at 612, the exponent's bias a word
	// at 868 (stepBF16AVX512VBMI).
	bf16Table
}

//go:noescape
func stepBF16AVX2(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func stepBF16AVX512(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func stepBF16AVX512BF16(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func stepBF16AVX512VBMI(pp, gg, mm, vv *uint16, n int, k *vecConsts)

// stepBF16Vec runs the head of a bfloat16 step (a multiple of 8 elements)
// in assembly and returns how many elements it did.
func stepBF16Vec(p, g, m, v []uint16, s Scalars, k f32, epsBF float32) int {
	w, n := lanes(len(p))
	if w+n == 0 || s.Amsgrad {
		return 0
	}
	c := vecConsts{pass1Consts: newPass1Consts(s, k), bc2s: k.bc2s, eps: epsBF, negStep: k.negStep}
	c.setRounding(0x7FC0)
	c.setWide()
	switch {
	case w > 0 && vecISA >= ISAAVX512VBMI && c.bf16Table.fill(k.bc2s):
		stepBF16AVX512VBMI(&p[0], &g[0], &m[0], &v[0], w, &c)
	case w > 0 && vecISA >= ISAAVX512BF16:
		stepBF16AVX512BF16(&p[0], &g[0], &m[0], &v[0], w, &c)
	case w > 0:
		stepBF16AVX512(&p[0], &g[0], &m[0], &v[0], w, &c)
	}
	if n > 0 {
		stepBF16AVX2(&p[w], &g[w], &m[w], &v[w], n, &c)
	}
	return w + n
}

//go:noescape
func fusedF32AVX2(pp, gg, mm, vv *float32, n int, k *vecConsts)

//go:noescape
func fusedBF16AVX2(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func fusedF32AVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)

//go:noescape
func fusedBF16AVX512(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func fusedBF16AVX512BF16(pp, gg, mm, vv *uint16, n int, k *vecConsts)

//go:noescape
func narrowBF16AVX512BF16(dst *uint16, src *float32, n int, k *vecConsts)

// newFusedConsts packs a fused step's constants for the assembly: decay,
// lerp and exp_avg_sq constants as newPass1Consts packs them.
func newFusedConsts(k fusedScalars) vecConsts {
	c := vecConsts{pass1Consts: lerpConsts(k.decay, k.w, k.b2, k.c, k.applyDecay, k.maximize), bc2s: k.bc2s,
		eps: k.eps, negStep: k.negStep}
	// Vector-loop NaNs become 0xFFFF, as torch's vectorized bfloat16 conversion makes them.
	c.setRounding(0xFFFF)
	c.setWide()
	return c
}

// setDivide fills the reciprocal of bc2s and +inf the division by bc2s
// uses (divide_amd64.h).
func (c *vecConsts) setDivide() {
	y := 1 / c.bc2s // a float32 division: RN(1/bc2s)
	for i := range c.rbc2s {
		c.rbc2s[i], c.inf[i] = y, 0x7F800000
	}
}

// setWide fills c.wide from the scalars, and what setDivide fills.
func (c *vecConsts) setWide() {
	c.setDivide()
	words := [9]uint32{math.Float32bits(c.decay), math.Float32bits(c.c), math.Float32bits(c.b2),
		math.Float32bits(c.omb2), c.sign, c.baseMask, math.Float32bits(c.bc2s), math.Float32bits(c.eps),
		math.Float32bits(c.negStep)}
	for i := range c.wide[0] {
		for j, w := range words {
			c.wide[j][i] = w
		}
		c.wide[9][i] = ^c.baseMask
	}
}

// setRounding fills the masks of the bfloat16 roundings (RBFI, RNDBFOR,
// ZRBFI, ZRBFO: round to nearest even) and the pattern a stored NaN gets
// (nan).
func (c *vecConsts) setRounding(nan uint32) {
	for i := range c.one {
		c.one[i], c.r7fff[i], c.hiMask[i], c.nan[i] = 1, 0x7FFF, 0xFFFF0000, nan<<16
		c.lsb[i], c.abs[i], c.inf[i] = 0x10000, 0x7FFFFFFF, 0x7F800000
	}
}

// fusedF32Vec runs the vector-loop elements of a fused float32 step (an FMA
// build, no amsgrad) in assembly, a multiple of 8 from the start, and
// returns how many it did.
func fusedF32Vec(p, g, m, v []float32, k fusedScalars) int {
	w, n := lanes(len(p))
	if w+n == 0 || !k.fma || k.amsgrad || !divisorOK(k.bc2s) {
		return 0
	}
	g, m, v = g[:w+n], m[:w+n], v[:w+n]
	c := newFusedConsts(k)
	if w > 0 {
		fusedF32AVX512(&p[0], &g[0], &m[0], &v[0], w, &c)
	}
	if n > 0 {
		fusedF32AVX2(&p[w], &g[w], &m[w], &v[w], n, &c)
	}
	return w + n
}

// fusedBF16Vec is fusedF32Vec for bfloat16 bit patterns.
func fusedBF16Vec(p, g, m, v []uint16, k fusedScalars) int {
	w, n := lanes(len(p))
	if w+n == 0 || !k.fma || k.amsgrad || !divisorOK(k.bc2s) {
		return 0
	}
	g, m, v = g[:w+n], m[:w+n], v[:w+n]
	c := newFusedConsts(k)
	switch {
	case w > 0 && vecISA >= ISAAVX512BF16:
		fusedBF16AVX512BF16(&p[0], &g[0], &m[0], &v[0], w, &c)
	case w > 0:
		fusedBF16AVX512(&p[0], &g[0], &m[0], &v[0], w, &c)
	}
	if n > 0 {
		fusedBF16AVX2(&p[w], &g[w], &m[w], &v[w], n, &c)
	}
	return w + n
}
