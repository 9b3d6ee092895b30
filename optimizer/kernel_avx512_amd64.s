#include "textflag.h"

#include "prefetch_amd64.h"
#include "divide_amd64.h"
#include "mklsqrt_amd64.h"

// AVX-512F versions of the passes in kernel_amd64.s: the same IEEE
// single-precision operations in the same order, 16 lanes at a time (so the
// results are bitwise those of the AVX2 passes and of the scalar Go code).
// Only AVX-512 Foundation instructions are used: the bitwise logic is the
// integer VPANDD/VPORD/VPXORD family (VANDPS and friends on Z registers need
// AVX-512DQ), a NaN test yields a mask register, and bfloat16 is narrowed
// with VPMOVDW. The AVX-512 BF16 conversion (VCVTNEPS2BF16) is not used: it
// flushes subnormal inputs to zero and keeps a NaN's payload, where torch
// rounds subnormals to nearest even and writes one fixed NaN pattern.
//
// n must be a multiple of 16 in every function here.

// ZPASS1MV is the exp_avg and exp_avg_sq half of pass 1 for the 16 elements
// at BX (g at SI, m at R8, v at R9): m' in Z4 and v' in Z5, both stored. Z9
// lerp coefficient, Z10 beta2, Z11 1-beta2, Z12 sign mask, Z13 base mask;
// Z0, Z2, Z3 and Z6 are clobbered.
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

// func pass1AVX512(pp, gg, mm, vv, out *float32, n int, k *pass1Consts)
TEXT ·pass1AVX512(SB), NOSPLIT, $0-56
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ out+32(FP), R10
	MOVQ n+40(FP), CX
	MOVQ k+48(FP), AX
	VBROADCASTSS 0(AX), Z8   // decay
	VBROADCASTSS 4(AX), Z9   // lerp coefficient: w, or w-1
	VBROADCASTSS 8(AX), Z10  // beta2
	VBROADCASTSS 12(AX), Z11 // 1-beta2
	VPBROADCASTD 16(AX), Z12 // sign mask (maximize)
	VPBROADCASTD 20(AX), Z13 // base mask: all ones when the lerp base is the gradient
	XORQ BX, BX
loop1:
	CMPQ BX, CX
	JGE done1
	PREFETCH4(4)
	ZPASS1MV
	VMOVUPS Z5, (R10)(BX*4)
	VMOVUPS (DI)(BX*4), Z1
	VMULPS Z8, Z1, Z1         // p *= decay
	VMOVUPS Z1, (DI)(BX*4)
	ADDQ $16, BX
	JMP loop1
done1:
	VZEROUPPER
	RET

// func pass2AVX512(pp, mm, sq *float32, n int, k *vecConsts)
TEXT ·pass2AVX512(SB), NOSPLIT, $0-40
	MOVQ pp+0(FP), DI
	MOVQ mm+8(FP), SI
	MOVQ sq+16(FP), R8
	MOVQ n+24(FP), CX
	MOVQ k+32(FP), AX
	VBROADCASTSS 152(AX), Z14 // bias_correction2_sqrt
	VBROADCASTSS 156(AX), Z9  // eps
	VBROADCASTSS 160(AX), Z10 // -step_size
	XORQ BX, BX
loop2:
	CMPQ BX, CX
	JGE done2
	VMOVUPS (R8)(BX*4), Z0
	ZDIVBC(Z0, Z3, Z4, K1)    // sqrt(v) / bc2s
	VADDPS Z9, Z3, Z0         // + eps
	VMOVUPS (SI)(BX*4), Z1
	VMULPS Z10, Z1, Z1        // value * m
	VDIVPS Z0, Z1, Z1         // / denom
	VMOVUPS (DI)(BX*4), Z2
	VADDPS Z1, Z2, Z2         // p + ...
	VMOVUPS Z2, (DI)(BX*4)
	ADDQ $16, BX
	JMP loop2
done2:
	VZEROUPPER
	RET

// func sqrtAVX512(dst, src *float32, n int)
TEXT ·sqrtAVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ BX, BX
loop3:
	CMPQ BX, CX
	JGE done3
	VSQRTPS (SI)(BX*4), Z0
	VMOVUPS Z0, (DI)(BX*4)
	ADDQ $16, BX
	JMP loop3
done3:
	VZEROUPPER
	RET

// ZRNDCONSTS loads the rounding masks of a vecConsts (AX) into Z16-Z19.
#define ZRNDCONSTS \
	VPBROADCASTD 0(AX), Z16; \
	VPBROADCASTD 32(AX), Z17; \
	VPBROADCASTD 64(AX), Z18; \
	VPBROADCASTD 96(AX), Z19

// ZLOADBF widens 16 bfloat16 values at addr to float32 lanes of x.
#define ZLOADBF(addr, x) \
	VPMOVZXWD addr, x; \
	VPSLLD $16, x, x

// ZSTOREBF stores the 16 lanes of x as bfloat16: the high half of each lane,
// rounded (ZRBFI, ZRBFS or ZRBFO; the low half is dropped).
#define ZSTOREBF(x, t, addr) \
	VPSRLD $16, x, t; \
	VPMOVDW t, addr

// ZSTEPCONSTS broadcasts a vecConsts step's constants (AX points at it) into
// Z8-Z15 and Z20: decay, lerp coefficient, beta2, 1-beta2, sign mask, base
// mask, bias_correction2_sqrt, eps (bfloat16-rounded for the bf16 step),
// -step_size.
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

// ZRBFI rounds x to bfloat16 precision in place (round to nearest even) in
// four integer operations: x plus 0x7FFF (Z17), plus one (Z16) where its
// bit 16 (Z21) is set, low half cleared (Z18); k is clobbered. Like RBFI in
// kernel_amd64.s it leaves a NaN as it is, which inside stepBF16AVX512 is
// already a rounded one (every NaN there has a zero low half). ZRBFS is
// ZRBFI for a value that is stored: a NaN becomes the pattern in Z19.
#define ZRBFI(x, k) \
	VPTESTMD Z21, x, k; \
	VPADDD Z17, x, x; \
	VPADDD Z16, x, k, x; \
	VPANDD Z18, x, x

#define ZRBFS(x, k) \
	ZRBFI(x, k); \
	VCMPPS $3, x, x, k; \
	VMOVDQA32 Z19, k, x

// ZLOADEO widens the 32 bfloat16 values at addr, read as 16 32-bit words, to
// the float32 lanes of e (the even elements) and o (the odd ones); ZSTOREEO
// is its inverse for two rounded blocks (t clobbered).
#define ZLOADEO(addr, e, o) \
	VMOVDQU32 addr, o; \
	VPSLLD $16, o, e; \
	VPANDD Z18, o, o

#define ZSTOREEO(e, o, t, addr) \
	VPSRLD $16, e, t; \
	VPORD o, t, t; \
	VMOVDQU32 t, addr

// The stages of the 32-element loop for one half (SW3-SW6 in
// kernel_amd64.s on 16 lanes; the loop below them shows the operations one
// block at a time). K4 holds the lerp's base choice.
#define ZSW3(g, m, t, u, k) \
	VSUBPS m, g, t; \
	VPBLENDMD g, m, K4, u; \
	VFMADD231PS t, Z9, u; \
	ZRBFS(u, k)

#define ZSW4(g, v, t, k) \
	VMULPS Z10, v, v; \
	ZRBFI(v, k); \
	VMULPS Z11, g, t; \
	VFMADD231PS g, t, v; \
	ZRBFS(v, k)

#define ZSW5(v, t, k) \
	VSQRTPS v, t; \
	ZRBFI(t, k); \
	VDIVPS Z14, t, t; \
	ZRBFI(t, k); \
	VADDPS Z15, t, t; \
	ZRBFI(t, k)

#define ZSW6(g, p, t, u, k) \
	VMULPS u, Z20, g; \
	VDIVPS t, g, g; \
	VADDPS g, p, p; \
	ZRBFS(p, k)

// ZBF16SETUP loads the constants of a bfloat16 step, single-tensor or fused
// (vecConsts at AX; DI p, SI g, R8 m, R9 v, CX n): DX is n rounded down
// to 32, BX 0, K4 the lerp's base choice.
#define ZBF16SETUP \
	ZRNDCONSTS; \
	ZSTEPCONSTS; \
	VPBROADCASTD 484(AX), Z21; \
	VPTESTMD Z13, Z13, K4; \
	MOVQ CX, DX; \
	ANDQ $-32, DX; \
	XORQ BX, BX

// ZBF16PAIR steps the 32 elements at BX as two blocks of 16 lanes, the even
// and the odd elements (ZLOADEO), their stages interleaved, with the
// roundings of ZRBFI.
#define ZBF16PAIR \
	ZLOADEO((SI)(BX*2), Z0, Z5); \
	VPXORD Z12, Z0, Z0; \
	VPXORD Z12, Z5, Z5; \
	ZLOADEO((DI)(BX*2), Z1, Z6); \
	VMULPS Z8, Z1, Z1; \
	VMULPS Z8, Z6, Z6; \
	ZRBFI(Z1, K2); \
	ZRBFI(Z6, K3); \
	ZLOADEO((R8)(BX*2), Z2, Z7); \
	ZSW3(Z0, Z2, Z3, Z4, K2); \
	ZSW3(Z5, Z7, Z22, Z23, K3); \
	ZLOADEO((R9)(BX*2), Z2, Z7); \
	ZSTOREEO(Z4, Z23, Z24, (R8)(BX*2)); \
	ZSW4(Z0, Z2, Z3, K2); \
	ZSW4(Z5, Z7, Z22, K3); \
	ZSTOREEO(Z2, Z7, Z24, (R9)(BX*2)); \
	ZSW5(Z2, Z3, K2); \
	ZSW5(Z7, Z22, K3); \
	ZSW6(Z0, Z1, Z3, Z4, K2); \
	ZSW6(Z5, Z6, Z22, Z23, K3); \
	ZSTOREEO(Z1, Z6, Z24, (DI)(BX*2))

// ZBF16TAIL steps the elements from BX to CX 16 at a time (a block of the
// same stages alone: ZLOADBF, ZSTOREBF) and returns.
#define ZBF16TAIL(loop, done) \
loop: \
	CMPQ BX, CX; \
	JGE done; \
	ZLOADBF((SI)(BX*2), Z0); \
	VPXORD Z12, Z0, Z0; \
	ZLOADBF((DI)(BX*2), Z1); \
	VMULPS Z8, Z1, Z1; \
	ZRBFI(Z1, K2); \
	ZLOADBF((R8)(BX*2), Z2); \
	ZSW3(Z0, Z2, Z3, Z4, K2); \
	ZLOADBF((R9)(BX*2), Z2); \
	ZSTOREBF(Z4, Z5, (R8)(BX*2)); \
	ZSW4(Z0, Z2, Z3, K2); \
	ZSTOREBF(Z2, Z5, (R9)(BX*2)); \
	ZSW5(Z2, Z3, K2); \
	ZSW6(Z0, Z1, Z3, Z4, K2); \
	ZSTOREBF(Z1, Z5, (DI)(BX*2)); \
	ADDQ $16, BX; \
	JMP loop; \
done: \
	VZEROUPPER; \
	RET

// func stepBF16AVX512(pp, gg, mm, vv *uint16, n int, k *vecConsts)
//
// 32 elements an iteration (ZBF16PAIR), then 16 (ZBF16TAIL).
TEXT ·stepBF16AVX512(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZBF16SETUP
loopbw:
	CMPQ BX, DX
	JGE loopb
	PREFETCH4(2)
	ZBF16PAIR
	ADDQ $32, BX
	JMP loopbw
	ZBF16TAIL(loopb, doneb)

// ZFUSEDH is FUSED8 (kernel_amd64.s) on 16 lanes: g, p (in: loaded, out:
// updated, unrounded), m (in) and v (in, out: new v) on the given
// registers; out: mo = new m, t6 = denominator; g, t3, t7 and K1 clobbered.
// K4 holds the lerp's base choice (Z13 tested), which VPBLENDMD applies. It
// divides by bc2s without the divider (ZDIVBC, divide_amd64.h): float32
// 0.56 -> 0.40 ns an element on one core in L2, bfloat16 0.56 -> 0.54
// (2026-12-02).
#define ZFUSEDH(g, p, m, v, t3, mo, t6, t7) \
	VPXORD Z12, g, g; \
	VMULPS Z8, p, p; \
	VSUBPS m, g, t3; \
	VPBLENDMD g, m, K4, mo; \
	VFMADD231PS t3, Z9, mo; \
	VMULPS Z10, v, v; \
	VMULPS Z11, g, t6; \
	VFMADD231PS g, t6, v; \
	VSQRTPS v, t6; \
	ZDIVBC(t6, g, t3, K1); \
	VADDPS Z15, g, t6; \
	VMULPS mo, Z20, t7; \
	VDIVPS t6, t7, t7; \
	VADDPS t7, p, p

// ZFUSED16 is ZFUSEDH with Z0 = g, Z1 = p, Z2 = m, Z5 = v; out: Z4 = new m,
// Z5 = new v.
#define ZFUSED16 ZFUSEDH(Z0, Z1, Z2, Z5, Z3, Z4, Z6, Z7)

// ZRBFO rounds x to bfloat16 for a store by ZSTOREEOF (the bfloat16 in the
// high half of each lane, the low half garbage), a NaN as 0xFFFF (Z19): the
// fused kernels' vector NaN; k1 and k2 are clobbered.
#define ZRBFO(x, k1, k2) \
	VCMPPS $3, x, x, k1; \
	VPTESTMD Z21, x, k2; \
	VPADDD Z17, x, x; \
	VPADDD Z16, x, k2, x; \
	VMOVDQA32 Z19, k1, x

// ZSTOREEOF stores two blocks rounded by ZRBFO, the even elements' (e) and
// the odd ones' (o), as the 32 bfloat16 values at addr: e's high halves
// moved down, o's high halves kept (VPTERNLOGD: Z18 ? o : t); t clobbered.
#define ZSTOREEOF(e, o, t, addr) \
	VPSRLD $16, e, t; \
	VPTERNLOGD $0xD8, Z18, o, t; \
	VMOVDQU32 t, addr

// func fusedF32AVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)
TEXT ·fusedF32AVX512(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZSTEPCONSTS
	VPTESTMD Z13, Z13, K4
	XORQ BX, BX
loopf:
	CMPQ BX, CX
	JGE donef
	PREFETCH4(4)
	VMOVUPS (SI)(BX*4), Z0
	VMOVUPS (DI)(BX*4), Z1
	VMOVUPS (R8)(BX*4), Z2
	VMOVUPS (R9)(BX*4), Z5
	ZFUSED16
	VMOVUPS Z4, (R8)(BX*4)
	VMOVUPS Z5, (R9)(BX*4)
	VMOVUPS Z1, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopf
donef:
	VZEROUPPER
	RET

// The parts of the fused bfloat16 kernels (fusedBF16AVX512 and, below,
// fusedBF16AVX512BF16), which differ only in how a pair of blocks is
// narrowed for its store.
//
// ZFUSEDBF16SETUP loads the arguments and constants (ZBF16SETUP): DX is n
// rounded down to a multiple of 32, BX the element index.
#define ZFUSEDBF16SETUP \
	MOVQ pp+0(FP), DI; \
	MOVQ gg+8(FP), SI; \
	MOVQ mm+16(FP), R8; \
	MOVQ vv+24(FP), R9; \
	MOVQ n+32(FP), CX; \
	MOVQ k+40(FP), AX; \
	ZBF16SETUP

// ZFUSEDBF16PAIR computes the 32 elements at BX as two blocks of 16 lanes,
// the even and the odd elements (ZLOADEO): new m in Z4 / Z27, new v in
// Z5 / Z25, new p in Z1 / Z23, all unrounded.
#define ZFUSEDBF16PAIR \
	PREFETCH4(2); \
	ZLOADEO((SI)(BX*2), Z0, Z22); \
	ZLOADEO((DI)(BX*2), Z1, Z23); \
	ZLOADEO((R8)(BX*2), Z2, Z24); \
	ZLOADEO((R9)(BX*2), Z5, Z25); \
	ZFUSEDH(Z0, Z1, Z2, Z5, Z3, Z4, Z6, Z7); \
	ZFUSEDH(Z22, Z23, Z24, Z25, Z26, Z27, Z28, Z29)

// ZSTOREPAIR rounds a pair of blocks with ZRBFO and stores them at addr.
#define ZSTOREPAIR(e, o, addr) \
	ZRBFO(e, K2, K3); \
	ZRBFO(o, K5, K6); \
	ZSTOREEOF(e, o, Z30, addr)

// ZFUSEDBF16TAIL is the last block of 16 (n - DX elements), alone
// (ZLOADBF, ZSTOREBF), then the return.
#define ZFUSEDBF16TAIL(loop, done) \
loop: \
	CMPQ BX, CX; \
	JGE done; \
	ZLOADBF((SI)(BX*2), Z0); \
	ZLOADBF((DI)(BX*2), Z1); \
	ZLOADBF((R8)(BX*2), Z2); \
	ZLOADBF((R9)(BX*2), Z5); \
	ZFUSED16; \
	ZRBFO(Z4, K2, K3); \
	ZSTOREBF(Z4, Z2, (R8)(BX*2)); \
	ZRBFO(Z5, K2, K3); \
	ZSTOREBF(Z5, Z2, (R9)(BX*2)); \
	ZRBFO(Z1, K2, K3); \
	ZSTOREBF(Z1, Z2, (DI)(BX*2)); \
	ADDQ $16, BX; \
	JMP loop; \
done: \
	VZEROUPPER; \
	RET

// func fusedBF16AVX512(pp, gg, mm, vv *uint16, n int, k *vecConsts)
//
// 32 elements an iteration (ZFUSEDBF16PAIR), rounded with ZRBFO; a last
// block of 16 runs alone.
TEXT ·fusedBF16AVX512(SB), NOSPLIT, $0-48
	ZFUSEDBF16SETUP
loopfw:
	CMPQ BX, DX
	JGE loopfb
	ZFUSEDBF16PAIR
	ZSTOREPAIR(Z4, Z27, (R8)(BX*2))
	ZSTOREPAIR(Z5, Z25, (R9)(BX*2))
	ZSTOREPAIR(Z1, Z23, (DI)(BX*2))
	ADDQ $32, BX
	JMP loopfw
	ZFUSEDBF16TAIL(loopfb, donefb)

// The emulation of MKL's AVX-512 vmsSqrt kernel (mkl_vml_kernel_sSqrt_Z0HAynn,
// what MKL runs on Intel CPUs with AVX-512; see sqrt.go): r = rsqrt14(x)
// (an approximation the architecture defines exactly), h = r*0.5, s = r*x,
// y = fma(fma(-s, s, x), h, s). Lanes with r > 2^39 (x below about 2^-78)
// take the same steps on x*2^78, s*2^39 and h*2^-78; ±0 and +inf give x, a
// negative number (-inf included, -0 not) the NaN 0x7FC00000, as MKL's
// scalar code does. MKL classifies with VFPCLASSPS (AVX-512DQ); here
// integer compares do it, AVX-512F only. The rounding is the MXCSR's
// (nearest, no flush to zero: Go's), as MKL's {rn-sae} and its MXCSR set
// for VML_FTZDAZ_OFF.
DATA zmklConsts<>+0(SB)/4, $0x3f000000  // 0.5
DATA zmklConsts<>+4(SB)/4, $0x53000000  // 2^39
DATA zmklConsts<>+8(SB)/4, $0x66800000  // 2^78
DATA zmklConsts<>+12(SB)/4, $0x18800000 // 2^-78
DATA zmklConsts<>+16(SB)/4, $0x7fc00000 // MKL's NaN
DATA zmklConsts<>+20(SB)/4, $0x7fffffff // |x|
DATA zmklConsts<>+24(SB)/4, $0x7f800000 // +inf
DATA zmklConsts<>+28(SB)/4, $0x80000001 // the first negative number after -0
GLOBL zmklConsts<>(SB), RODATA|NOPTR, $32

// ZMKLCONSTS broadcasts zmklConsts into Z24-Z31.
#define ZMKLCONSTS \
	VPBROADCASTD zmklConsts<>+0(SB), Z24; \
	VPBROADCASTD zmklConsts<>+4(SB), Z25; \
	VPBROADCASTD zmklConsts<>+8(SB), Z26; \
	VPBROADCASTD zmklConsts<>+12(SB), Z27; \
	VPBROADCASTD zmklConsts<>+16(SB), Z28; \
	VPBROADCASTD zmklConsts<>+20(SB), Z29; \
	VPBROADCASTD zmklConsts<>+24(SB), Z30; \
	VPBROADCASTD zmklConsts<>+28(SB), Z31

// ZMKLSQRT sets y to the emulation's square root of x (ZMKLCONSTS loaded),
// clobbering r, s, t, K2-K5. Branch-free: with no lane below 2^-78 the
// masked scaling changes nothing, and the steps are those of MKL's main path.
#define ZMKLSQRT(x, y, r, s, t) \
	VRSQRT14PS x, r; \
	VMULPS Z24, r, y; \
	VMULPS x, r, s; \
	VCMPPS $1, r, Z25, K2; \
	VMOVAPS x, t; \
	VMULPS Z26, x, K2, t; \
	VMOVAPS s, r; \
	VMULPS Z25, s, K2, r; \
	VMULPS Z27, y, K2, y; \
	VFNMADD213PS t, r, r; \
	VFMADD213PS s, y, r; \
	VPTESTNMD Z29, x, K3; \
	VPCMPEQD Z30, x, K4; \
	KORW K3, K4, K3; \
	VMOVAPS x, K3, r; \
	VPSUBD Z31, x, t; \
	VPCMPUD $1, Z30, t, K5; \
	VMOVAPS Z28, K5, r; \
	VMOVAPS r, y

// func mklSqrtAVX512(dst, src *float32, n int)
TEXT ·mklSqrtAVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	ZMKLCONSTS
	XORQ BX, BX
loopz:
	CMPQ BX, CX
	JGE donez
	VMOVUPS (SI)(BX*4), Z0
	ZMKLSQRT(Z0, Z1, Z2, Z3, Z4)
	VMOVUPS Z1, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopz
donez:
	VZEROUPPER
	RET

// ZSTEPF32P is the second half of a one-pass float32 step for the 16
// elements at BX, pass2AVX512's operations: Z0 the square root in, m' in Z4,
// the constants of ZSTEPCONSTS; p updated and stored.
#define ZSTEPF32P \
	VDIVPS Z14, Z0, Z0; \
	ZSTEPF32Q(Z0)

// ZSTEPF32D is ZSTEPF32P dividing by bc2s without the divider (ZDIVBC; Z2
// and Z3 clobbered): for the IEEE square root, whose own use of the divider
// leaves it the bound. The MKL emulation (ZMKLSQRT) uses none, and its loop
// is bound by the other vector operations, which ZDIVBC adds to (0.43 ->
// 0.46 ns an element measured on one core in L2, 2026-12-02): it keeps VDIVPS.
#define ZSTEPF32D \
	ZDIVBC(Z0, Z2, Z3, K1); \
	ZSTEPF32Q(Z2)

// ZSTEPF32Q is the rest of ZSTEPF32P from the quotient in q.
#define ZSTEPF32Q(q) \
	VADDPS Z15, q, Z0; \
	VMULPS Z20, Z4, Z6; \
	VDIVPS Z0, Z6, Z6; \
	VMOVUPS (DI)(BX*4), Z1; \
	VMULPS Z8, Z1, Z1; \
	VADDPS Z6, Z1, Z1; \
	VMOVUPS Z1, (DI)(BX*4)

// func stepF32IEEEAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)
// One pass: pass1AVX512, VSQRTPS and pass2AVX512 per 16 lanes, the same
// operations with the same first sources (the decay applied in the second
// half, as stepF32IEEEAVX2 does); the division by bc2s is ZDIVBC's (ZSTEPF32D:
// 0.56 -> 0.40 ns an element on one core in L2, 2026-12-02).
TEXT ·stepF32IEEEAVX512(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZSTEPCONSTS
	XORQ BX, BX
loopzi:
	CMPQ BX, CX
	JGE donezi
	PREFETCH4(4)
	ZPASS1MV
	VSQRTPS Z5, Z0
	ZSTEPF32D
	ADDQ $16, BX
	JMP loopzi
donezi:
	VZEROUPPER
	RET

// func stepF32MKLAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts)
// One pass: pass1AVX512, ZMKLSQRT and pass2AVX512 per 16 lanes (see
// stepF32IEEEAVX512).
TEXT ·stepF32MKLAVX512(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZSTEPCONSTS
	ZMKLCONSTS
	XORQ BX, BX
loopzs:
	CMPQ BX, CX
	JGE donezs
	PREFETCH4(4)
	ZPASS1MV
	ZMKLSQRT(Z5, Z0, Z16, Z17, Z18)
	ZSTEPF32P
	ADDQ $16, BX
	JMP loopzs
donezs:
	VZEROUPPER
	RET

// func divBCAVX512(dst, src *float32, n int, k *vecConsts)
// dst = src / bc2s with ZDIVBC, 16 lanes at a time (n a multiple of 16):
// TestDivideByRecip's view of the macro the kernels use.
TEXT ·divBCAVX512(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ k+24(FP), AX
	VBROADCASTSS 152(AX), Z14
	XORQ BX, BX
loopdz:
	CMPQ BX, CX
	JGE donedz
	VMOVUPS (SI)(BX*4), Z0
	ZDIVBC(Z0, Z1, Z2, K1)
	VMOVUPS Z1, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopdz
donedz:
	VZEROUPPER
	RET

// The AVX-512 BF16 narrowing of the fused bfloat16 kernel (ISAAVX512BF16).
//
// VCVTNE2PS2BF16 rounds two blocks of 16 float32 lanes to bfloat16 in one
// instruction, where ZRBFO takes five integer operations a block and
// ZSTOREEOF two more a pair. It rounds to nearest even, as torch does,
// every value but two kinds: a subnormal becomes a signed zero (torch rounds
// it) and a NaN keeps its payload (torch's vector conversion writes 0xFFFF).
// So ZCVTCHECK classifies both blocks first (VFPCLASSPS, AVX-512DQ: QNaN,
// SNaN or subnormal) and jumps to the ZRBFO narrowing when one lane of the
// 32 is one of them. TestBF16NarrowingAllFloat32 compares the two ways for
// every float32 bit pattern. Measured on one core of an Intel Xeon with
// AVX-512 BF16, 16K elements in L2: 0.515 -> 0.451 ns an element
// (2026-12-02).
//
// Go's assembler does not know VCVTNE2PS2BF16: VCVT2_o_e are its bytes
// (EVEX.512.F2.0F38.W0 72 /r) for the register pairs the loop uses, with
// Z30 the destination: Z30's words 0-15 are e's lanes rounded, 16-31 o's.
#define VCVT2_Z27_Z4 BYTE $0x62; BYTE $0x62; BYTE $0x27; BYTE $0x40; BYTE $0x72; BYTE $0xf4
#define VCVT2_Z25_Z5 BYTE $0x62; BYTE $0x62; BYTE $0x37; BYTE $0x40; BYTE $0x72; BYTE $0xf5
#define VCVT2_Z23_Z1 BYTE $0x62; BYTE $0x62; BYTE $0x47; BYTE $0x40; BYTE $0x72; BYTE $0xf1

// ZCVTCHECK jumps to slow if a lane of e or o is a NaN or subnormal
// (VFPCLASSPS categories QNaN 0x01, denormal 0x20, SNaN 0x80); K2 and K3
// are clobbered.
#define ZCVTCHECK(e, o, slow) \
	VFPCLASSPSZ $0xA1, e, K2; \
	VFPCLASSPSZ $0xA1, o, K3; \
	KORTESTW K2, K3; \
	JNE slow

// ZSTORECVT stores Z30 (a VCVT2's result: the even elements, then the odd
// ones) in memory order at addr; Z31 holds bf16Interleave.
#define ZSTORECVT(addr) \
	VPERMW Z30, Z31, Z30; \
	VMOVDQU32 Z30, addr

// ZSTOREPAIRCVT narrows the pair of blocks e and o with cvt (their VCVT2)
// and stores it at addr, or jumps to slow if a lane is a NaN or subnormal.
#define ZSTOREPAIRCVT(e, o, cvt, addr, slow) \
	ZCVTCHECK(e, o, slow); \
	cvt; \
	ZSTORECVT(addr)

// bf16Interleave is the VPERMW index of ZSTORECVT: word j of memory takes
// word j/2 + 16*(j&1) of a VCVT2's result.
DATA bf16Interleave<>+0(SB)/8, $0x0011000100100000
DATA bf16Interleave<>+8(SB)/8, $0x0013000300120002
DATA bf16Interleave<>+16(SB)/8, $0x0015000500140004
DATA bf16Interleave<>+24(SB)/8, $0x0017000700160006
DATA bf16Interleave<>+32(SB)/8, $0x0019000900180008
DATA bf16Interleave<>+40(SB)/8, $0x001b000b001a000a
DATA bf16Interleave<>+48(SB)/8, $0x001d000d001c000c
DATA bf16Interleave<>+56(SB)/8, $0x001f000f001e000e
GLOBL bf16Interleave<>(SB), RODATA|NOPTR, $64

// func fusedBF16AVX512BF16(pp, gg, mm, vv *uint16, n int, k *vecConsts)
//
// fusedBF16AVX512 with each pair of blocks narrowed by VCVT2 unless
// ZCVTCHECK finds a NaN or subnormal lane (then by ZRBFO, as there).
TEXT ·fusedBF16AVX512BF16(SB), NOSPLIT, $0-48
	ZFUSEDBF16SETUP
	VMOVDQU32 bf16Interleave<>(SB), Z31
loopcw:
	CMPQ BX, DX
	JGE loopcb
	ZFUSEDBF16PAIR
	ZSTOREPAIRCVT(Z4, Z27, VCVT2_Z27_Z4, (R8)(BX*2), slowm)
storev:
	ZSTOREPAIRCVT(Z5, Z25, VCVT2_Z25_Z5, (R9)(BX*2), slowv)
storep:
	ZSTOREPAIRCVT(Z1, Z23, VCVT2_Z23_Z1, (DI)(BX*2), slowp)
	ADDQ $32, BX
	JMP loopcw
slowm:
	ZSTOREPAIR(Z4, Z27, (R8)(BX*2))
	JMP storev
slowv:
	ZSTOREPAIR(Z5, Z25, (R9)(BX*2))
	JMP storep
slowp:
	ZSTOREPAIR(Z1, Z23, (DI)(BX*2))
	ADDQ $32, BX
	JMP loopcw
	ZFUSEDBF16TAIL(loopcb, donecb)

// func narrowBF16AVX512BF16(dst *uint16, src *float32, n int, k *vecConsts)
//
// The fused kernel's narrowing alone, for TestBF16NarrowingAllFloat32: each
// 32 float32 values at src, taken as an even block (the first 16) and an odd
// one (the next 16), are narrowed and stored as fusedBF16AVX512BF16 stores
// them: dst[2i] from src[i], dst[2i+1] from src[16+i]. n is a multiple of 32.
TEXT ·narrowBF16AVX512BF16(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ k+24(FP), AX
	ZRNDCONSTS
	VPBROADCASTD 484(AX), Z21
	VMOVDQU32 bf16Interleave<>(SB), Z31
	XORQ BX, BX
loopn:
	CMPQ BX, CX
	JGE donen
	VMOVUPS (SI)(BX*4), Z4
	VMOVUPS 64(SI)(BX*4), Z27
	ZSTOREPAIRCVT(Z4, Z27, VCVT2_Z27_Z4, (DI)(BX*2), slown)
	ADDQ $32, BX
	JMP loopn
slown:
	ZSTOREPAIR(Z4, Z27, (DI)(BX*2))
	ADDQ $32, BX
	JMP loopn
donen:
	VZEROUPPER
	RET

// The bfloat16 single-tensor step on AVX-512 BF16 (ISAAVX512BF16).
//
// torch's single-tensor step rounds to bfloat16 after every operation, eight
// times an element. ZRBFI's four integer operations a block for each were
// half the loop's time (on an AMD EPYC, one core, 64K elements: 0.85 ns an
// element, 0.41 with each rounding cut to one operation). Here a rounding of
// a pair of blocks is one VCVT2, which leaves their 32 words in a register,
// and two unpacks with zero (VPUNPCKLWD, VPUNPCKHWD: one cycle of latency,
// where a VPERMW to put the words back where they were takes five) that
// widen them to float32 lanes again.
//
// The unpacks do not restore the lane order. Take a pair as eight groups of
// four elements (four per register; a group is a quadword of bfloat16): a
// rounding takes groups (x0..x3 | x4..x7) to (x0 x2 x4 x6 | x1 x3 x5 x7),
// a permutation r with r^3 = 1. Loading a quadword-ordered memory block by
// the same unpacks gives r(memory order), "order 1"; a VPERMQ before them
// gives order 0 (index bf16Order0, which also takes a rounding of order 1
// back to memory order) or 2. Every value of the step keeps to one:
//   order 0: exp_avg_sq as loaded (through VPERMQ bf16Order0) and times
//            beta2; the square root rounded, divided by
//            bias_correction2_sqrt;
//   order 1: g, p and m as loaded; p*decay; the lerp (the new exp_avg);
//            exp_avg_sq*beta2 rounded, plus g*g*(1-beta2) (the new
//            exp_avg_sq); the quotient rounded, plus eps;
//   order 2: p*decay rounded; the new exp_avg and exp_avg_sq rounded; the
//            square root; the denominator (eps added, rounded); the new
//            parameter, whose rounding VPERMQ bf16Order2 puts in memory
//            order;
// so every operation meets its operands in one order, and three VPERMQs
// put a pair's results in memory order.
//
// VCVT2 rounds as ZRBFI does every value but a subnormal (it becomes a
// signed zero) and a NaN (it keeps its payload). The pair is therefore
// stepped into registers only, then checked, then stored:
//   - VPTESTMW finds a zero word among the roundings of p*decay, the new
//     exp_avg, exp_avg_sq*beta2, the new exp_avg_sq and the new parameter: a subnormal rounds to a zero there. The three
//     roundings left unchecked cannot meet one: the square root of a nonzero
//     bfloat16 is at least 2^-63, and dividing it by bias_correction2_sqrt
//     (at most 1) and adding eps (at least 0) make it no smaller.
//   - VCMPPS finds a NaN in the new parameter before its rounding: every
//     value of the step flows into it, and a NaN passes through every
//     operation of the step, so a NaN anywhere reaches it.
// A pair with a zero (a true one included: an expert no token reached has
// zero moments) or a NaN is stepped again by ZBF16PAIR, whose roundings are
// torch's for every value. TestStepBF16EachCheck makes each check alone
// decide a block (each one removed fails it); it, TestStepBF16TinyAndZero
// and the other tests of kernel_paths_test.go compare the kernels with the
// Go code. On one core of an AMD EPYC, 64K elements in L2: 0.54 ns an
// element against 0.85 for stepBF16AVX512 (2026-12-05).

// bf16Order0 and bf16Order2 are VPERMQ indexes: bf16Order0 takes a block
// of memory to the quadword order that the unpacks widen to order 0, and a
// rounding of order 1 to memory order; bf16Order2 takes a rounding of
// order 2 to memory order.
DATA bf16Order0<>+0(SB)/8, $0
DATA bf16Order0<>+8(SB)/8, $4
DATA bf16Order0<>+16(SB)/8, $1
DATA bf16Order0<>+24(SB)/8, $5
DATA bf16Order0<>+32(SB)/8, $2
DATA bf16Order0<>+40(SB)/8, $6
DATA bf16Order0<>+48(SB)/8, $3
DATA bf16Order0<>+56(SB)/8, $7
GLOBL bf16Order0<>(SB), RODATA|NOPTR, $64
DATA bf16Order2<>+0(SB)/8, $0
DATA bf16Order2<>+8(SB)/8, $2
DATA bf16Order2<>+16(SB)/8, $4
DATA bf16Order2<>+24(SB)/8, $6
DATA bf16Order2<>+32(SB)/8, $1
DATA bf16Order2<>+40(SB)/8, $3
DATA bf16Order2<>+48(SB)/8, $5
DATA bf16Order2<>+56(SB)/8, $7
GLOBL bf16Order2<>(SB), RODATA|NOPTR, $64

// ZBF16PAIRCVT steps the 32 elements at BX as ZBF16PAIR does, with the
// roundings of VCVT2, into registers: the new exp_avg in Z30, exp_avg_sq in
// Z31 and parameter in Z29, each in memory order; K1 all ones if no rounding
// checked met a zero, K3 if the new parameter is no NaN. Z25 holds
// bf16Order0, Z26 bf16Order2, Z28 0x7FFF a word, Z13 zero; the step's
// scalars are broadcast from memory (AX). Its instructions go in this
// order: exp_avg_sq's chain first (it leads to the divider), then p*decay,
// the lerp, and the denominator and the new parameter.
//
// ZBF16QUADCVT steps the 64 elements at BX as two such pairs whose
// instructions alternate: a pair's chain of dependent operations, from
// exp_avg_sq's load to the new parameter, is longer than the processor's
// window reaches when one pair runs alone (one core in L2: 0.64 ns an
// element with one pair an iteration, 0.54 with two). The pair at BX has
// ZBF16PAIRCVT's registers (Z0-Z7, Z22-Z24, Z29-Z31), the pair at BX+32
// Z8-Z12, Z14-Z21 and Z27 (new exp_avg in Z27, exp_avg_sq in Z16, parameter
// in Z15; zero checks in K2); K3 takes both NaN checks.
//
// Both are generated (bf16cvt_gen_amd64_test.go writes them from one
// pair's list of instructions and encodes the VCVT2s, which Go's assembler
// does not know).
#include "bf16cvt_amd64.h"

// ZBF16RELOAD broadcasts the constants ZBF16PAIR and ZBF16TAIL keep in
// registers, which ZBF16QUADCVT takes for data, and zeroes Z13 for the
// unpacks.
#define ZBF16RELOAD \
	ZRNDCONSTS; \
	ZSTEPCONSTS; \
	VPBROADCASTD 484(AX), Z21; \
	VPXORD Z13, Z13, Z13

// ZBF16CVTSETUP is ZBF16SETUP with what ZBF16STEPLOOP keeps in registers:
// Z13 zero, Z25 bf16Order0, Z26 bf16Order2, Z28 0x7FFF a word.
#define ZBF16CVTSETUP \
	ZBF16SETUP; \
	VPXORD Z13, Z13, Z13; \
	VMOVDQU64 bf16Order0<>(SB), Z25; \
	VMOVDQU64 bf16Order2<>(SB), Z26; \
	MOVL $0x7FFF7FFF, R10; \
	VPBROADCASTD R10, Z28

// ZBF16STEPLOOP is the loop of stepBF16AVX512BF16 and stepBF16AVX512VBMI:
// the elements at BX stepped by QUAD 64 at a time, then by PAIR 32 at a
// time, then by ZBF16TAIL; a group whose checks fail is stepped again by
// ZBF16PAIR. The rest of the arguments are its labels.
#define ZBF16STEPLOOP(QUAD, PAIR, loopqw, loopqd, slowq, loopvw, loopvb, slowv, donevb) \
loopqw: \
	CMPQ BX, R11; \
	JGE loopqd; \
	PREFETCH4(2); \
	PREFETCHT0 (PFDIST+64)(SI)(BX*2); \
	PREFETCHT0 (PFDIST+64)(DI)(BX*2); \
	PREFETCHT0 (PFDIST+64)(R8)(BX*2); \
	PREFETCHT0 (PFDIST+64)(R9)(BX*2); \
	QUAD; \
	KANDD K1, K2, K1; \
	KORTESTD K1, K1; \
	JCC slowq; \
	KORTESTW K3, K3; \
	JCC slowq; \
	VMOVDQU32 Z30, (R8)(BX*2); \
	VMOVDQU32 Z27, 64(R8)(BX*2); \
	VMOVDQU32 Z31, (R9)(BX*2); \
	VMOVDQU32 Z16, 64(R9)(BX*2); \
	VMOVDQU32 Z29, (DI)(BX*2); \
	VMOVDQU32 Z15, 64(DI)(BX*2); \
	ADDQ $64, BX; \
	JMP loopqw; \
slowq: \
	ZBF16RELOAD; \
	ZBF16PAIR; \
	ADDQ $32, BX; \
	ZBF16PAIR; \
	ADDQ $32, BX; \
	JMP loopqw; \
loopqd: \
	ZBF16RELOAD; \
loopvw: \
	CMPQ BX, DX; \
	JGE loopvb; \
	PREFETCH4(2); \
	PAIR; \
	KORTESTD K1, K1; \
	JCC slowv; \
	KORTESTW K3, K3; \
	JCC slowv; \
	VMOVDQU32 Z30, (R8)(BX*2); \
	VMOVDQU32 Z31, (R9)(BX*2); \
	VMOVDQU32 Z29, (DI)(BX*2); \
	ADDQ $32, BX; \
	JMP loopvw; \
slowv: \
	ZBF16PAIR; \
	ADDQ $32, BX; \
	JMP loopvw; \
	ZBF16TAIL(loopvb, donevb)

// func stepBF16AVX512BF16(pp, gg, mm, vv *uint16, n int, k *vecConsts)
//
// stepBF16AVX512 with the elements stepped by ZBF16QUADCVT and
// ZBF16PAIRCVT (ZBF16STEPLOOP).
TEXT ·stepBF16AVX512BF16(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZBF16CVTSETUP
	MOVQ CX, R11
	ANDQ $-64, R11
	ZBF16STEPLOOP(ZBF16QUADCVT, ZBF16PAIRCVT, loopqw, loopqd, slowq, loopvw, loopvb, slowv, donevb)

// The constants of ZBF16PAIRTBL's check and exponent: 0x0080 and 0x00FF a
// word, 0xFF80 a word (a doubleword to broadcast).
DATA bf16W0080<>+0(SB)/8, $0x0080008000800080
DATA bf16W0080<>+8(SB)/8, $0x0080008000800080
DATA bf16W0080<>+16(SB)/8, $0x0080008000800080
DATA bf16W0080<>+24(SB)/8, $0x0080008000800080
DATA bf16W0080<>+32(SB)/8, $0x0080008000800080
DATA bf16W0080<>+40(SB)/8, $0x0080008000800080
DATA bf16W0080<>+48(SB)/8, $0x0080008000800080
DATA bf16W0080<>+56(SB)/8, $0x0080008000800080
GLOBL bf16W0080<>(SB), RODATA|NOPTR, $64
DATA bf16W00FF<>+0(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+8(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+16(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+24(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+32(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+40(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+48(SB)/8, $0x00FF00FF00FF00FF
DATA bf16W00FF<>+56(SB)/8, $0x00FF00FF00FF00FF
GLOBL bf16W00FF<>(SB), RODATA|NOPTR, $64
DATA bf16WFF80<>+0(SB)/4, $0xFF80FF80
GLOBL bf16WFF80<>(SB), RODATA|NOPTR, $4

// func stepBF16AVX512VBMI(pp, gg, mm, vv *uint16, n int, k *vecConsts)
//
// stepBF16AVX512BF16 with the square root of the new exp_avg_sq divided by
// bias_correction2_sqrt, both rounded, looked up in the step's table
// (k.bf16Table, bf16table.go): ZBF16PAIRTBL and ZBF16QUADTBL. A pair's new
// exp_avg_sq words, in memory order, index the table's 256 bytes by their
// low byte (the exponent's low bit and the mantissa): VPERMT2B looks up 128
// bytes at a time, by each byte's low 7 bits, VPMOVB2M and VPBLENDMB take
// the half its bit 7 names, K7 (the even bytes) zeroes the odd bytes; the
// exponent comes from VPAVGW with the table's bias. The quotient is then in
// memory order, which the unpacks widen to order 1, as the computed one
// was. In place of the zero check of the new exp_avg_sq, a check that it is
// a positive normal number (VPADDW, VPCMPW): a zero, subnormal, infinite,
// NaN or negative one would find a wrong entry, and its pair is stepped by
// ZBF16PAIR. Only VPTESTMW's zero checks and VCMPPS's NaN check of the new
// parameter remain as in stepBF16AVX512BF16: a NaN reaches the new
// parameter through every value but exp_avg_sq's, whose own check sends it
// to ZBF16PAIR. On one core of an AMD EPYC, 64K elements in L2: 0.45 ns an
// element against 0.54 for stepBF16AVX512BF16 (2026-12-05).
TEXT ·stepBF16AVX512VBMI(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	ZBF16CVTSETUP
	MOVQ $0x5555555555555555, R10
	KMOVQ R10, K7
	MOVQ CX, R11
	ANDQ $-64, R11
	ZBF16STEPLOOP(ZBF16QUADTBL, ZBF16PAIRTBL, loopqt, loopqdt, slowqt, loopvt, loopvbt, slowvt, donevbt)

// MKL's SSE and AVX2 (FMA) vmsSqrt kernels (kernel_onepass_amd64.s: MKLSQRT,
// MKLSQRTFMA) on 16 lanes. Their approximation is the CPU's VRSQRTPS, which
// has no 512-bit form (VRSQRT14PS is another, exactly defined approximation,
// the one MKL's AVX-512 kernel uses), so each 16-lane block takes it on its
// two 256-bit halves; the Newton step is the 8-lane code's macro
// (mklsqrt_amd64.h) on Z registers, and the lanes MKL treats apart are
// found and fixed as MKLSPECIAL and MKLFIX do, with mask registers. The
// results are those of the 8-lane emulations bit for bit
// (TestWideMKLSqrtAllFloat32 compares the two on every float32 input).

// ZSSECONSTS broadcasts the 8-lane kernels' constants (kernel_onepass_amd64.s):
// Z21 = 0.5, Z22 = the special-lane bias (and +inf's bits), Z23 = the
// threshold of the kernel that fma (a byte at FP offset off) names, Z24 =
// MKL's NaN, Z25 = the first negative number after -0; R10 = fma.
#define ZSSECONSTS(off) \
	VPBROADCASTD ·mklHalf(SB), Z21; \
	VPBROADCASTD ·mklBias(SB), Z22; \
	VPBROADCASTD ·mklThresh(SB), Z23; \
	MOVBQZX off(FP), R10; \
	TESTQ R10, R10; \
	JEQ 2(PC); \
	VPBROADCASTD ·mklThreshFMA(SB), Z23; \
	VPBROADCASTD ·mklNaN(SB), Z24; \
	VPBROADCASTD ·mklNegLo(SB), Z25

// ZRSQRT sets Z7 to VRSQRTPS of the 16 lanes of x (in Z0-Z15, xlo its Y
// name: the 256-bit halves are VEX operands), clobbering Y6.
#define ZRSQRT(x, xlo) \
	VEXTRACTF64X4 $1, x, Y6; \
	VRSQRTPS xlo, Y7; \
	VRSQRTPS Y6, Y6; \
	VINSERTF64X4 $1, Y6, Z7, Z7

// ZSSESQRT and ZFMASQRT set Z0 to the SSE and the FMA kernel's square root
// of x (ZSSECONSTS loaded; Z6, Z7, Z16-Z18 clobbered).
#define ZSSESQRT(x, xlo) \
	ZRSQRT(x, xlo); \
	MKLNEWTON(x, Z0, Z7, Z16, Z17, Z18, Z21)

#define ZFMASQRT(x, xlo) \
	ZRSQRT(x, xlo); \
	MKLNEWTONFMA(x, Z0, Z7, Z16, Z17, Z21)

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

// ZSQRTSEL is ZSSESQRT, or ZFMASQRT where R10 (ZSSECONSTS's fma) is set, as
// MKLSQRTSEL chooses (a branch the CPU predicts every time); fmal and donel
// name the two labels it places.
#define ZSQRTSEL(x, xlo, fmal, donel) \
	TESTQ R10, R10; \
	JNE fmal; \
	ZSSESQRT(x, xlo); \
	JMP donel; \
fmal: \
	ZFMASQRT(x, xlo); \
donel:

// func mklSqrtSSEAVX512(dst, src *float32, n int, fma bool)
TEXT ·mklSqrtSSEAVX512(SB), NOSPLIT, $0-25
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	ZSSECONSTS(fma+24)
	XORQ BX, BX
loopw:
	CMPQ BX, CX
	JGE donew
	VMOVUPS (SI)(BX*4), Z5
	ZSQRTSEL(Z5, Y5, fmaw, specialw)
	ZSSESPECIAL(Z5, rarew)
storew:
	VMOVUPS Z0, (DI)(BX*4)
	ADDQ $16, BX
	JMP loopw
rarew:
	ZSSEFIX(Z5)
	JMP storew
donew:
	VZEROUPPER
	RET

// func stepF32MKLSSEAVX512(pp, gg, mm, vv *float32, n int, k *vecConsts, fma bool)
// One pass over 16 lanes a block: ZPASS1MV, the square root of ZSQRTSEL and
// ZSTEPF32P, the 8-lane MKL step's operations (stepF32MKLAVX2).
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
loops:
	CMPQ BX, CX
	JGE dones
	PREFETCH4(4)
	ZPASS1MV
	ZSQRTSEL(Z5, Y5, fmas, specials)
	ZSSESPECIAL(Z5, rares)
nexts:
	ZSTEPF32P
	ADDQ $16, BX
	JMP loops
rares:
	ZSSEFIX(Z5)
	JMP nexts
dones:
	VZEROUPPER
	RET
