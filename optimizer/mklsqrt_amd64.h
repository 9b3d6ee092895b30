// The Newton step of MKL's SSE and AVX2 vmsSqrt kernels (see sqrt.go), after
// the approximation r = VRSQRTPS(x), for 8 lanes (Y registers,
// kernel_onepass_amd64.s) or 16 (Z registers, kernel_avx512_amd64.s): the
// same instructions in the same order, so both widths give the same bits
// (TestWideMKLSqrtAllFloat32). half holds 0.5 in every lane.

// MKLNEWTON is the SSE kernel's step in unfused multiplies and adds; y = the
// square root, r, s, t and e clobbered (e may be half's register, which it
// then clobbers).
//
//	s = x*r; h = 0.5*r; e = 0.5 - s*h
//	s1 = s*e + s; h1 = e*h + h; y = (x - s1*s1)*h1 + s1
#define MKLNEWTON(x, y, r, s, t, e, half) \
	VMULPS x, r, s; \
	VMULPS half, r, r; \
	VMULPS r, s, t; \
	VSUBPS t, half, e; \
	VMULPS e, s, t; \
	VADDPS s, t, s; \
	VMULPS e, r, t; \
	VADDPS r, t, r; \
	VMULPS s, s, t; \
	VSUBPS t, x, t; \
	VMULPS r, t, t; \
	VADDPS s, t, y

// MKLNEWTONFMA is the AVX2 kernel's step with fused multiply-adds:
// e = fma(-s, h, 0.5); s1 = fma(e, s, s); h1 = fma(e, h, h);
// y = fma(h1, fma(-s1, s1, x), s1); r, s and t clobbered.
#define MKLNEWTONFMA(x, y, r, s, t, half) \
	VMULPS x, r, s; \
	VMULPS half, r, r; \
	VMOVAPS r, t; \
	VFNMADD213PS half, s, t; \
	VFMADD231PS s, t, s; \
	VFMADD231PS r, t, r; \
	VMOVAPS s, t; \
	VFNMADD213PS x, s, t; \
	VFMADD213PS s, r, t; \
	VMOVAPS t, y
