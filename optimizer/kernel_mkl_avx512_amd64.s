#include "textflag.h"
#include "prefetch_amd64.h"

// MKL's SSE and AVX2 (FMA) vmsSqrt kernels (see kernel_onepass_amd64.s:
// MKLSQRT, MKLSQRTFMA) on 16 lanes. Their approximation is the CPU's
// VRSQRTPS, which has no 512-bit form (VRSQRT14PS is another, exactly
// defined approximation, the one MKL's AVX-512 kernel uses), so each 16-lane
// block takes it on its two 256-bit halves; every other operation is the
// 8-lane code's, in the same order and with the same first sources, on Z
// registers. The results are those of the 8-lane emulations bit for bit
// (TestMKLSqrtWideAllFloat32 compares the two on every float32 input).
// AVX-512F only (the lane tests are integer compares into mask registers).
//
// n must be a multiple of 16 in every function here.

DATA zmklSSE<>+0(SB)/4, $0x3f000000  // 0.5
DATA zmklSSE<>+4(SB)/4, $0x7f800000  // the special-lane bias (and +inf)
DATA zmklSSE<>+8(SB)/4, $0xfefff000  // the SSE kernel's special-lane threshold
DATA zmklSSE<>+12(SB)/4, $0xfeffffff // the FMA kernel's
DATA zmklSSE<>+16(SB)/4, $0x7fc00000 // MKL's NaN
DATA zmklSSE<>+20(SB)/4, $0x80000001 // the first negative number after -0
GLOBL zmklSSE<>(SB), RODATA|NOPTR, $24

// ZSSECONSTS loads Z21 = 0.5, Z22 = bias, Z23 = the threshold of the kernel
// that fma (a byte at FP offset off) names, Z24 = MKL's NaN, Z25 = the first
// negative number; R10 = fma.
#define ZSSECONSTS(off) \
	VPBROADCASTD zmklSSE<>+0(SB), Z21; \
	VPBROADCASTD zmklSSE<>+4(SB), Z22; \
	VPBROADCASTD zmklSSE<>+8(SB), Z23; \
	MOVBQZX off(FP), R10; \
	TESTQ R10, R10; \
	JEQ 2(PC); \
	VPBROADCASTD zmklSSE<>+12(SB), Z23; \
	VPBROADCASTD zmklSSE<>+16(SB), Z24; \
	VPBROADCASTD zmklSSE<>+20(SB), Z25

// ZRSQRT sets Z7 to VRSQRTPS of the 16 lanes of x (Z0-Z15: the 256-bit
// halves are VEX operands), clobbering Y6.
#define ZRSQRT(x, xlo) \
	VEXTRACTF64X4 $1, x, Y6; \
	VRSQRTPS xlo, Y7; \
	VRSQRTPS Y6, Y6; \
	VINSERTF64X4 $1, Y6, Z7, Z7

// ZSSESQRT is MKLSQRT on 16 lanes: Z0 = the SSE kernel's square root of x
// (r = Z7, s = Z16, t = Z17, e = Z18 clobbered).
//
//	r = rsqrt(x); s = x*r; h = 0.5*r; e = 0.5 - s*h
//	s1 = s*e + s; h1 = e*h + h; y = (x - s1*s1)*h1 + s1
#define ZSSESQRT(x, xlo) \
	ZRSQRT(x, xlo); \
	VMULPS x, Z7, Z16; \
	VMULPS Z21, Z7, Z7; \
	VMULPS Z7, Z16, Z17; \
	VSUBPS Z17, Z21, Z18; \
	VMULPS Z18, Z16, Z17; \
	VADDPS Z16, Z17, Z16; \
	VMULPS Z18, Z7, Z17; \
	VADDPS Z7, Z17, Z7; \
	VMULPS Z16, Z16, Z17; \
	VSUBPS Z17, x, Z17; \
	VMULPS Z7, Z17, Z17; \
	VADDPS Z16, Z17, Z0

// ZFMASQRT is MKLSQRTFMA on 16 lanes: Z0 = the FMA kernel's square root of
// x: e = fma(-s, h, 0.5); s1 = fma(e, s, s); h1 = fma(e, h, h);
// y = fma(h1, fma(-s1, s1, x), s1).
#define ZFMASQRT(x, xlo) \
	ZRSQRT(x, xlo); \
	VMULPS x, Z7, Z16; \
	VMULPS Z21, Z7, Z7; \
	VMOVAPS Z7, Z17; \
	VFNMADD213PS Z21, Z16, Z17; \
	VFMADD231PS Z16, Z17, Z16; \
	VFMADD231PS Z7, Z17, Z7; \
	VMOVAPS Z16, Z17; \
	VFNMADD213PS x, Z16, Z17; \
	VFMADD213PS Z16, Z7, Z17; \
	VMOVAPS Z17, Z0

// ZSSESPECIAL sets K1 to the lanes of x that MKL's vector code does not
// compute (x + bias > threshold as signed integers; MKLSPECIAL) and jumps to
// rare if there is one; Z17 is clobbered.
#define ZSSESPECIAL(x, rare) \
	VPADDD Z22, x, Z17; \
	VPCMPGTD Z23, Z17, K1; \
	KORTESTW K1, K1; \
	JNE rare

// ZSSEFIX is MKLFIX on 16 lanes: the lanes of Z0 in K1 take the IEEE square
// root of x, and a negative x other than -0 (x - 0x80000001 below +inf's
// bits, unsigned) gives MKL's NaN; Z17 and K2 are clobbered.
#define ZSSEFIX(x) \
	VSQRTPS x, K1, Z0; \
	VPSUBD Z25, x, Z17; \
	VPCMPUD $1, Z22, Z17, K2; \
	VMOVAPS Z24, K2, Z0

// func mklSqrtSSEAVX512(dst, src *float32, n int, fma bool)
TEXT ·mklSqrtSSEAVX512(SB), NOSPLIT, $0-25
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	ZSSECONSTS(fma+24)
	XORQ BX, BX
	TESTQ R10, R10
	JNE loopwf
loopws:
	CMPQ BX, CX
	JGE donew
	VMOVUPS (SI)(BX*4), Z5
	ZSSESQRT(Z5, Y5)
	ZSSESPECIAL(Z5, rarews)
storews:
	VMOVUPS Z0, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopws
rarews:
	ZSSEFIX(Z5)
	JMP storews
loopwf:
	CMPQ BX, CX
	JGE donew
	VMOVUPS (SI)(BX*4), Z5
	ZFMASQRT(Z5, Y5)
	ZSSESPECIAL(Z5, rarewf)
storewf:
	VMOVUPS Z0, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopwf
rarewf:
	ZSSEFIX(Z5)
	JMP storewf
donew:
	VZEROUPPER
	RET

// ZPASS1MV is the exp_avg and exp_avg_sq half of a one-pass step for the 16
// elements at BX (as kernel_avx512_amd64.s's, which this file cannot
// include): m' in Z4 and v' in Z5, both stored; Z0, Z2, Z3 and Z6 clobbered.
#define ZPASS1MV \
	VMOVUPS (SI)(BX*4), Z0; \
	VPXORD Z12, Z0, Z0; \
	VMOVUPS (R8)(BX*4), Z2; \
	VSUBPS Z2, Z0, Z3; \
	VPANDD Z13, Z0, Z4; \
	VPANDND Z2, Z13, Z5; \
	VPORD Z5, Z4, Z4; \
	VFMADD231PS Z3, Z9, Z4; \
	VMOVUPS Z4, (R8)(BX*4); \
	VMOVUPS (R9)(BX*4), Z5; \
	VMULPS Z10, Z5, Z5; \
	VMULPS Z11, Z0, Z6; \
	VFMADD231PS Z0, Z6, Z5; \
	VMOVUPS Z5, (R9)(BX*4)

// ZPASS2 is the parameter half from the square root in Z0 and m' in Z4:
// p*decay + (-step*m')/(sqrt/bc2s + eps), stored (P2 of the 8-lane MKL
// kernel: the division by bc2s on the divider).
#define ZPASS2 \
	VDIVPS Z14, Z0, Z0; \
	VADDPS Z15, Z0, Z0; \
	VMULPS Z20, Z4, Z6; \
	VDIVPS Z0, Z6, Z6; \
	VMOVUPS (DI)(BX*4), Z1; \
	VMULPS Z8, Z1, Z1; \
	VADDPS Z6, Z1, Z1; \
	VMOVUPS Z1, (DI)(BX*4)

// ZSTEPCONSTS as in kernel_avx512_amd64.s: Z8-Z15 and Z20 from the
// vecConsts at AX.
#define ZSTEPCONSTS \
	VBROADCASTSS 128(AX), Z8; \
	VBROADCASTSS 132(AX), Z9; \
	VBROADCASTSS 136(AX), Z10; \
	VBROADCASTSS 140(AX), Z11; \
	VPBROADCASTD 144(AX), Z12; \
	VPBROADCASTD 148(AX), Z13; \
	VBROADCASTSS 152(AX), Z14; \
	VBROADCASTSS 156(AX), Z15; \
	VBROADCASTSS 160(AX), Z20

// func stepF32MKLSSEAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts, fma bool)
// One pass over 16 lanes a block: the 8-lane MKL step's operations
// (stepF32MKLAVX2) with the square root of ZSSESQRT, or ZFMASQRT where fma
// is set (two loops; the choice is made once).
TEXT ·stepF32MKLSSEAVX512(SB), NOSPLIT, $0-49
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZSTEPCONSTS
	ZSSECONSTS(fma+48)
	XORQ BX, BX
	TESTQ R10, R10
	JNE loopsf
loopss:
	CMPQ BX, CX
	JGE dones
	PREFETCH4(4)
	ZPASS1MV
	ZSSESQRT(Z5, Y5)
	ZSSESPECIAL(Z5, raress)
nextss:
	ZPASS2
	ADDQ $16, BX
	JMP loopss
raress:
	ZSSEFIX(Z5)
	JMP nextss
loopsf:
	CMPQ BX, CX
	JGE dones
	PREFETCH4(4)
	ZPASS1MV
	ZFMASQRT(Z5, Y5)
	ZSSESPECIAL(Z5, raresf)
nextsf:
	ZPASS2
	ADDQ $16, BX
	JMP loopsf
raresf:
	ZSSEFIX(Z5)
	JMP nextsf
dones:
	VZEROUPPER
	RET
