// Dividing by bias_correction2_sqrt without the divider.
//
// torch divides sqrt(v) by bias_correction2_sqrt (b) for every element; the
// divider, shared with the square root and the other division, is what
// bounds the kernels. b is the same for the whole call, so its reciprocal
// y = RN(1/b) is computed once (in Go, a float32 division) and each quotient
// is corrected twice with fused multiply-adds (Markstein's iteration):
//
//	q0 = RN(x*y)                 within 2 ulps of x/b
//	r0 = RN(q0*b - x)            FMA
//	q1 = RN(q0 - r0*y)           FMA: within 1/2 ulp + 2^-22 ulp, so a faithful rounding of x/b
//	r1 = q1*b - x                FMA, exact: q1 is faithful (no underflow, below)
//	q2 = RN(q1 - r1*y)           FMA: RN(x/b) exactly, by Markstein's theorem
//	                             (y within 1/2 ulp of 1/b, q1 faithful)
//
// (the negated remainders b*q - x with VFMSUB/VFNMADD keep a -0 quotient's
// sign: -0 - (+0) is -0). The kernels call this only for b in [2^-32, 1]
// (float32 AdamW with beta2 in [0, 1) has b >= 2^-26.5; Go checks before
// calling), and x is a square root: +-0, +inf, NaN or a normal number in
// [2^-75, 2^64], so x*y neither overflows nor underflows and the remainders
// are multiples of 2^-122 (normal). +inf and NaN lanes (the iteration makes
// NaN of inf) take q0, which is x/b there as the divider gives it (inf, or
// x's NaN made quiet). TestDivideByRecip checks it against Go's division for
// every significand and the special values, over many b.
//
// The reciprocal is vecConsts.rbc2s (8 lanes at 580), +inf vecConsts.inf
// (548); the callers' AX holds the vecConsts.

// ZDIVBC sets t to x / bc2s for 16 lanes: b in Z14, y and +inf broadcast
// from memory; x is kept; u and k are clobbered.
#define ZDIVBC(x, t, u, k) \
	VMULPS.BCST 580(AX), x, t; \
	VCMPPS.BCST $0x15, 548(AX), x, k; \
	VMOVAPS x, u; \
	VFMSUB231PS Z14, t, u; \
	VFNMADD231PS.BCST 580(AX), u, t; \
	VMOVAPS x, u; \
	VFMSUB231PS Z14, t, u; \
	VFNMADD231PS.BCST 580(AX), u, t; \
	VMULPS.BCST 580(AX), x, k, t

// DIVBC sets t to x / b for 8 lanes (b a register or memory operand; y and
// +inf from memory); x is kept; u and m are clobbered. VCMPPS NLT_UQ flags
// x >= +inf or unordered.
#define DIVBC(x, t, u, m, b) \
	VMULPS 580(AX), x, t; \
	VMOVAPS x, u; \
	VFMSUB231PS b, t, u; \
	VFNMADD231PS 580(AX), u, t; \
	VMOVAPS x, u; \
	VFMSUB231PS b, t, u; \
	VFNMADD231PS 580(AX), u, t; \
	VCMPPS $0x15, 548(AX), x, m; \
	VMULPS 580(AX), x, u; \
	VBLENDVPS m, u, t, t
