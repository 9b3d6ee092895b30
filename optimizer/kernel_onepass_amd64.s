#include "textflag.h"
#include "prefetch_amd64.h"
#include "divide_amd64.h"
#include "mklsqrt_amd64.h"

// One-pass AVX2+FMA float32 AdamW steps (the single-tensor path, StepF32):
// each element is read and written once, its square root taken in registers
// between the exp_avg_sq update and the parameter update. Three square roots:
//
//   - stepF32IEEEAVX2: VSQRTPS, the IEEE square root.
//   - stepF32MKLAVX2: the arithmetic of MKL's vmsSqrt (high-accuracy mode) as
//     MKL's SSE kernel for CPUs outside Intel's paths computes it
//     (mkl_vml_kernel_sSqrt_EXHAynn, chosen on AMD EPYC): an approximate
//     reciprocal square root refined by one Newton step in unfused single-
//     precision multiplies and adds.
//   - stepF32MKLAVX2 with fma set: the same step with fused multiply-adds,
//     as MKL's kernel for Intel CPUs with AVX2 computes it
//     (mkl_vml_kernel_sSqrt_L9HAynn), which hands fewer lanes to its scalar
//     code.
//
// An MKL emulation is used only where a comparison with the client's vmsSqrt
// found it equal (see sqrt.go). On a CPU with AVX-512 the kernels take the
// 16-lane form of these emulations (kernel_avx512_amd64.s) for all but
// the last 8 elements.
//
// The lanes perform the same operations as pass1AVX2, the square root, and
// pass2AVX2, each operation with the same first source (the operand whose
// NaN an instruction passes on), so the results are those of the two-pass
// code bit for bit. The parameter's decay is applied in the second half
// (its product does not depend on when it is taken). The step's constants
// are memory operands (vecConsts.wide, AX), so that stepF32MKLAVX2 has every
// register for two blocks of 8 lanes.

// The MKL square root's constants: 0.5; the integer bias and the threshold
// that pick the lanes MKL hands to its scalar code (zero, subnormal, the
// largest 4095 finite values, infinities, NaNs, negative numbers); the NaN
// MKL returns for a negative number, and the start of the negative numbers
// (-0 excluded). Package symbols: the 16-lane kernels (kernel_avx512_amd64.s)
// broadcast the same ones.
DATA ·mklHalf+0(SB)/4, $0x3f000000
GLOBL ·mklHalf(SB), RODATA|NOPTR, $4
DATA ·mklBias+0(SB)/4, $0x7f800000
GLOBL ·mklBias(SB), RODATA|NOPTR, $4
DATA ·mklThresh+0(SB)/4, $0xfefff000
GLOBL ·mklThresh(SB), RODATA|NOPTR, $4
DATA ·mklThreshFMA+0(SB)/4, $0xfeffffff
GLOBL ·mklThreshFMA(SB), RODATA|NOPTR, $4
DATA ·mklNaN+0(SB)/4, $0x7fc00000
GLOBL ·mklNaN(SB), RODATA|NOPTR, $4
DATA ·mklNegLo+0(SB)/4, $0x80000001
GLOBL ·mklNegLo(SB), RODATA|NOPTR, $4

// MKLSQRT sets y to MKL's square root of the lanes of x, clobbering r, s, t
// and u (all distinct from x and y): VRSQRTPS, then MKLNEWTON
// (mklsqrt_amd64.h). Lanes MKL treats apart (see above) are fixed by MKLFIX
// when MKLRARE finds one.
#define MKLSQRT(x, y, r, s, t, u) \
	VRSQRTPS x, r; \
	VBROADCASTSS ·mklHalf(SB), u; \
	MKLNEWTON(x, y, r, s, t, u, u)

// MKLSQRT2 is MKLSQRT for two independent blocks, their instructions
// alternated: each block is one chain of dependent operations, which the
// core overlaps better when the two are interleaved.
#define MKLSQRT2(x, y, r, s, t, u, x2, y2, r2, s2, t2, u2) \
	VRSQRTPS x, r; \
	VRSQRTPS x2, r2; \
	VMULPS x, r, s; \
	VMULPS x2, r2, s2; \
	VBROADCASTSS ·mklHalf(SB), u; \
	VMOVAPS u, u2; \
	VMULPS u, r, r; \
	VMULPS u2, r2, r2; \
	VMULPS r, s, t; \
	VMULPS r2, s2, t2; \
	VSUBPS t, u, u; \
	VSUBPS t2, u2, u2; \
	VMULPS u, s, t; \
	VMULPS u2, s2, t2; \
	VADDPS s, t, s; \
	VADDPS s2, t2, s2; \
	VMULPS u, r, t; \
	VMULPS u2, r2, t2; \
	VADDPS r, t, r; \
	VADDPS r2, t2, r2; \
	VMULPS s, s, t; \
	VMULPS s2, s2, t2; \
	VSUBPS t, x, t; \
	VSUBPS t2, x2, t2; \
	VMULPS r, t, t; \
	VMULPS r2, t2, t2; \
	VADDPS s, t, y; \
	VADDPS s2, t2, y2

// MKLSQRTFMA is MKLSQRT with fused multiply-adds (MKL's kernel for Intel's
// AVX2 CPUs): MKLNEWTONFMA after the approximation.
#define MKLSQRTFMA(x, y, r, s, t, u) \
	VRSQRTPS x, r; \
	VBROADCASTSS ·mklHalf(SB), u; \
	MKLNEWTONFMA(x, y, r, s, t, u)

// MKLSQRTSEL is MKLSQRT, or MKLSQRTFMA where R10 (MKLTHRESH's fma) is set;
// fmal and donel name the two labels it places.
#define MKLSQRTSEL(x, y, r, s, t, u, fmal, donel) \
	TESTQ R10, R10; \
	JNE fmal; \
	MKLSQRT(x, y, r, s, t, u); \
	JMP donel; \
fmal: \
	MKLSQRTFMA(x, y, r, s, t, u); \
donel:

// MKLSQRTFMA2 is MKLSQRTFMA for two blocks, interleaved.
#define MKLSQRTFMA2(x, y, r, s, t, u, x2, y2, r2, s2, t2, u2) \
	VRSQRTPS x, r; \
	VRSQRTPS x2, r2; \
	VMULPS x, r, s; \
	VMULPS x2, r2, s2; \
	VBROADCASTSS ·mklHalf(SB), u; \
	VMULPS u, r, r; \
	VMULPS u, r2, r2; \
	VMOVAPS r, t; \
	VMOVAPS r2, t2; \
	VFNMADD213PS u, s, t; \
	VFNMADD213PS u, s2, t2; \
	VFMADD231PS s, t, s; \
	VFMADD231PS s2, t2, s2; \
	VFMADD231PS r, t, r; \
	VFMADD231PS r2, t2, r2; \
	VMOVAPS s, t; \
	VMOVAPS s2, t2; \
	VFNMADD213PS x, s, t; \
	VFNMADD213PS x2, s2, t2; \
	VFMADD213PS s, r, t; \
	VFMADD213PS s2, r2, t2; \
	VMOVAPS t, y; \
	VMOVAPS t2, y2

// MKLSPECIAL sets t to all ones in the lanes of x that MKL's vector code
// does not compute: x + 0x7F800000 > thresh as signed integers (thresh, a
// register, holds mklThresh for the SSE kernel, mklThreshFMA for the FMA
// one). k is clobbered.
#define MKLSPECIAL(x, t, k, thresh) \
	VPBROADCASTD ·mklBias(SB), k; \
	VPADDD k, x, t; \
	VPCMPGTD thresh, t, t

// MKLTHRESH sets Y13 to the special-lane threshold of the kernel the
// argument fma (a byte at FP offset off) names, and R10 to fma.
#define MKLTHRESH(off) \
	MOVBQZX off(FP), R10; \
	VPBROADCASTD ·mklThresh(SB), Y13; \
	TESTQ R10, R10; \
	JEQ 2(PC); \
	VPBROADCASTD ·mklThreshFMA(SB), Y13

// MKLFIX sets the lanes of y flagged in t to MKL's scalar results for x:
// the IEEE square root (MKL's scalar code is correctly rounded, which the
// exhaustive check confirms), except that a negative number other than -0
// and NaN gives the NaN 0x7FC00000: x - 0x80000001 in [0, 0x7F800000) as
// signed integers. t, u and k are clobbered.
#define MKLFIX(x, y, t, u, k) \
	VSQRTPS x, u; \
	VBLENDVPS t, u, y, y; \
	VPBROADCASTD ·mklNegLo(SB), k; \
	VPSUBD k, x, t; \
	VPBROADCASTD ·mklBias(SB), k; \
	VPCMPGTD t, k, u; \
	VPCMPEQD k, k, k; \
	VPCMPGTD k, t, t; \
	VPAND u, t, t; \
	VPBROADCASTD ·mklNaN(SB), u; \
	VBLENDVPS t, u, y, y

// func mklSqrtAVX2(dst, src *float32, n int, fma bool)
// n must be a multiple of 8; fma selects MKLSQRTFMA.
TEXT ·mklSqrtAVX2(SB), NOSPLIT, $0-25
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MKLTHRESH(fma+24)
	XORQ BX, BX
loopq:
	CMPQ BX, CX
	JGE doneq
	VMOVUPS (SI)(BX*4), Y0
	MKLSQRTSEL(Y0, Y1, Y2, Y3, Y4, Y5, fmaq, specialq)
	MKLSPECIAL(Y0, Y4, Y6, Y13)
	VPTEST Y4, Y4
	JNE rareq
storeq:
	VMOVUPS Y1, (DI)(BX*4)
	ADDQ $8, BX
	JMP loopq
rareq:
	MKLFIX(Y0, Y1, Y4, Y5, Y6)
	JMP storeq
doneq:
	VZEROUPPER
	RET

// The step's constants, vecConsts.wide: 8 lanes each.
#define W_DECAY 164(AX)
#define W_C 196(AX)
#define W_B2 228(AX)
#define W_OMB2 260(AX)
#define W_SIGN 292(AX)
#define W_BASE 324(AX)
#define W_BC2S 356(AX)
#define W_EPS 388(AX)
#define W_NEGSTEP 420(AX)
#define W_NOTBASE 452(AX)

// P1 is pass1AVX2 for the 8 elements at off bytes past BX without the
// decay: m and v updated and stored, the new v left in v. g, m, t1 and t2
// are clobbered. The constants are operands (registers or memory): sign,
// base mask and its complement, lerp coefficient, beta2, 1-beta2.
#define P1(off, g, m, v, t1, t2, sign, base, notbase, c, b2, omb2) \
	VMOVUPS off(SI)(BX*4), g; \
	VXORPS sign, g, g; \
	VMOVUPS off(R8)(BX*4), m; \
	VSUBPS m, g, t1; \
	VANDPS base, g, t2; \
	VANDPS notbase, m, m; \
	VORPS m, t2, t2; \
	VFMADD231PS c, t1, t2; \
	VMOVUPS t2, off(R8)(BX*4); \
	VMOVUPS off(R9)(BX*4), v; \
	VMULPS b2, v, v; \
	VMULPS omb2, g, t1; \
	VFMADD231PS g, t1, v; \
	VMOVUPS v, off(R9)(BX*4)

// P2 is pass2AVX2 for the 8 elements at off bytes past BX with the square
// root in y, and the decay: p*decay + (-step*m)/(y/bc2s + eps), stored. y, t
// and p are clobbered.
#define P2(off, y, t, p, bc2s, eps, negstep, decay) \
	VDIVPS bc2s, y, y; \
	P2Q(off, y, y, t, p, eps, negstep, decay)

// P2D is P2 dividing by bc2s without the divider (DIVBC; u and m clobbered
// too): for the IEEE square root, which leaves the divider the bound (the MKL
// emulations keep P2, as stepF32MKLAVX512 keeps VDIVPS).
#define P2D(off, y, t, p, u, m, bc2s, eps, negstep, decay) \
	DIVBC(y, t, u, m, bc2s); \
	P2Q(off, t, y, t, p, eps, negstep, decay)

// P2Q is the rest of P2 from the quotient in q (y: the denominator, made
// from it).
#define P2Q(off, q, y, t, p, eps, negstep, decay) \
	VADDPS eps, q, y; \
	VMOVUPS off(R8)(BX*4), t; \
	VMULPS negstep, t, t; \
	VDIVPS y, t, t; \
	VMOVUPS off(DI)(BX*4), p; \
	VMULPS decay, p, p; \
	VADDPS t, p, p; \
	VMOVUPS p, off(DI)(BX*4)

// func stepF32IEEEAVX2(pp, gg, mm, vv *float32, n int, k *vecConsts)
// n must be a multiple of 8. One block at a time with the constants in
// registers: 0.58-0.67 ns an element on one core in L2, against 0.73-0.86
// with them as memory operands and 0.90-1.05 for the two passes before
// (16K elements, 4 interleaved runs, 2026-12-01). Dividing by bc2s with
// DIVBC (P2D) instead of VDIVPS: 0.52 -> 0.42 on Intel (3 interleaved runs,
// 2026-12-02).
TEXT ·stepF32IEEEAVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	VMOVUPS W_DECAY, Y8
	VMOVUPS W_C, Y9
	VMOVUPS W_B2, Y10
	VMOVUPS W_OMB2, Y11
	VMOVUPS W_SIGN, Y12
	VMOVUPS W_BASE, Y13
	VMOVUPS W_BC2S, Y14
	VMOVUPS W_EPS, Y15
	XORQ BX, BX
loopi:
	CMPQ BX, CX
	JGE donei
	PREFETCH4(4)
	P1(0, Y0, Y1, Y2, Y3, Y4, Y12, Y13, W_NOTBASE, Y9, Y10, Y11)
	VSQRTPS Y2, Y5
	P2D(0, Y5, Y3, Y4, Y6, Y7, Y14, Y15, W_NEGSTEP, Y8)
	ADDQ $8, BX
	JMP loopi
donei:
	VZEROUPPER
	RET

#define P1W(off, g, m, v, t1, t2) P1(off, g, m, v, t1, t2, W_SIGN, W_BASE, W_NOTBASE, W_C, W_B2, W_OMB2)
#define P2W(off, y, t, p) P2(off, y, t, p, W_BC2S, W_EPS, W_NEGSTEP, W_DECAY)

// func stepF32MKLAVX2(pp, gg, mm, vv *float32, n int, k *vecConsts, fma bool)
// n must be a multiple of 8: two blocks of 8 an iteration, then one; fma
// selects MKLSQRTFMA (a branch the CPU predicts every time).
TEXT ·stepF32MKLAVX2(SB), NOSPLIT, $0-49
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	MKLTHRESH(fma+48)
	XORQ BX, BX
	MOVQ CX, DX
	SUBQ $8, DX
loopm:
	CMPQ BX, DX
	JGE lastm
	PREFETCH4(4)
	P1W(0, Y1, Y2, Y0, Y3, Y4)
	P1W(32, Y7, Y8, Y6, Y9, Y10)
	TESTQ R10, R10
	JNE fmam
	MKLSQRT2(Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11)
	JMP specialm
fmam:
	MKLSQRTFMA2(Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7, Y8, Y9, Y10, Y11)
specialm:
	MKLSPECIAL(Y0, Y4, Y12, Y13)
	MKLSPECIAL(Y6, Y10, Y12, Y13)
	VPOR Y4, Y10, Y12
	VPTEST Y12, Y12
	JNE rarem
nextm:
	P2W(0, Y1, Y2, Y3)
	P2W(32, Y7, Y8, Y9)
	ADDQ $16, BX
	JMP loopm
rarem:
	MKLFIX(Y0, Y1, Y4, Y5, Y12)
	MKLFIX(Y6, Y7, Y10, Y11, Y12)
	JMP nextm
lastm:
	CMPQ BX, CX
	JGE donem
	P1W(0, Y1, Y2, Y0, Y3, Y4)
	MKLSQRTSEL(Y0, Y1, Y2, Y3, Y4, Y5, fmal, speciall)
	MKLSPECIAL(Y0, Y4, Y12, Y13)
	VPTEST Y4, Y4
	JNE rarel
nextl:
	P2W(0, Y1, Y2, Y3)
donem:
	VZEROUPPER
	RET
rarel:
	MKLFIX(Y0, Y1, Y4, Y5, Y12)
	JMP nextl

// func divBCAVX2(dst, src *float32, n int, k *vecConsts)
// dst = src / bc2s with DIVBC, 8 lanes at a time (n a multiple of 8):
// TestDivideByRecip's view of the macro the kernels use.
TEXT ·divBCAVX2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ k+24(FP), AX
	VBROADCASTSS 152(AX), Y14
	XORQ BX, BX
loopdy:
	CMPQ BX, CX
	JGE donedy
	VMOVUPS (SI)(BX*4), Y0
	DIVBC(Y0, Y1, Y2, Y3, Y14)
	VMOVUPS Y1, (DI)(BX*4)
	ADDQ $8, BX
	JMP loopdy
donedy:
	VZEROUPPER
	RET
