#include "textflag.h"

// AVX2+FMA passes of the float32 AdamW step. They perform, lane for lane, the
// same IEEE single-precision operations as torch's vectorized CPU kernels
// (see StepF32), so the results are bitwise those of the scalar Go code.
//
// The constants block k (see pass1Consts and pass2Consts) holds broadcastable
// float32 values and masks.

// func pass1AVX2(pp, gg, mm, vv, out *float32, n int, k *pass1Consts)
// n must be a multiple of 8.
TEXT ·pass1AVX2(SB), NOSPLIT, $0-56
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ out+32(FP), R10
	MOVQ n+40(FP), CX
	MOVQ k+48(FP), AX
	VBROADCASTSS 0(AX), Y8   // decay
	VBROADCASTSS 4(AX), Y9   // lerp coefficient: w, or w-1
	VBROADCASTSS 8(AX), Y10  // beta2
	VBROADCASTSS 12(AX), Y11 // 1-beta2
	VBROADCASTSS 16(AX), Y12 // sign mask (maximize)
	VBROADCASTSS 20(AX), Y13 // base mask: all ones when the lerp base is the gradient
	XORQ BX, BX
loop1:
	CMPQ BX, CX
	JGE done1
	VMOVUPS (SI)(BX*4), Y0
	VXORPS Y12, Y0, Y0        // g = maximize ? -g : g
	VMOVUPS (DI)(BX*4), Y1
	VMULPS Y8, Y1, Y1         // p *= decay
	VMOVUPS Y1, (DI)(BX*4)
	VMOVUPS (R8)(BX*4), Y2    // m
	VSUBPS Y2, Y0, Y3         // d = g - m
	VANDPS Y13, Y0, Y4
	VANDNPS Y2, Y13, Y5
	VORPS Y5, Y4, Y4          // base = mask ? g : m
	VFMADD231PS Y3, Y9, Y4    // m' = fma(c, d, base)
	VMOVUPS Y4, (R8)(BX*4)
	VMOVUPS (R9)(BX*4), Y5
	VMULPS Y10, Y5, Y5        // v *= beta2
	VMULPS Y11, Y0, Y6        // (1-beta2)*g
	VFMADD231PS Y0, Y6, Y5    // v = fma((1-beta2)*g, g, v)
	VMOVUPS Y5, (R9)(BX*4)
	VMOVUPS Y5, (R10)(BX*4)
	ADDQ $8, BX
	JMP loop1
done1:
	VZEROUPPER
	RET

// func pass2AVX2(pp, mm, sq *float32, n int, k *pass2Consts)
TEXT ·pass2AVX2(SB), NOSPLIT, $0-40
	MOVQ pp+0(FP), DI
	MOVQ mm+8(FP), SI
	MOVQ sq+16(FP), R8
	MOVQ n+24(FP), CX
	MOVQ k+32(FP), AX
	VBROADCASTSS 0(AX), Y8  // bias_correction2_sqrt
	VBROADCASTSS 4(AX), Y9  // eps
	VBROADCASTSS 8(AX), Y10 // -step_size
	XORQ BX, BX
loop2:
	CMPQ BX, CX
	JGE done2
	VMOVUPS (R8)(BX*4), Y0
	VDIVPS Y8, Y0, Y0         // sqrt(v) / bc2s
	VADDPS Y9, Y0, Y0         // + eps
	VMOVUPS (SI)(BX*4), Y1
	VMULPS Y10, Y1, Y1        // value * m
	VDIVPS Y0, Y1, Y1         // / denom
	VMOVUPS (DI)(BX*4), Y2
	VADDPS Y1, Y2, Y2         // p + ...
	VMOVUPS Y2, (DI)(BX*4)
	ADDQ $8, BX
	JMP loop2
done2:
	VZEROUPPER
	RET

// func sqrtAVX(dst, src *float32, n int)
TEXT ·sqrtAVX(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ BX, BX
loop3:
	CMPQ BX, CX
	JGE done3
	VSQRTPS (SI)(BX*4), Y0
	VMOVUPS Y0, (DI)(BX*4)
	ADDQ $8, BX
	JMP loop3
done3:
	VZEROUPPER
	RET

// RNDBF rounds the float32 lanes of x to bfloat16 precision in place
// (round to nearest even; NaN becomes 0x7FC0), as c10::BFloat16 does. AX
// points at bf16Consts.
#define RNDBF(x, t1, t2) \
	VPSRLD $16, x, t1; \
	VPAND 0(AX), t1, t1; \
	VPADDD 32(AX), t1, t1; \
	VPADDD x, t1, t1; \
	VPAND 64(AX), t1, t1; \
	VCMPPS $3, x, x, t2; \
	VBLENDVPS t2, 96(AX), t1, x

// LOADBF widens 8 bfloat16 values at addr to float32 lanes of x.
#define LOADBF(addr, x) \
	VPMOVZXWD addr, x; \
	VPSLLD $16, x, x

// STOREBF stores the 8 lanes of x (already rounded by RNDBF) as bfloat16.
#define STOREBF(x, t, tx, addr) \
	VPSRLD $16, x, t; \
	VPACKUSDW t, t, t; \
	VPERMQ $0x08, t, t; \
	VMOVDQU tx, addr

// func stepBF16AVX2(pp, gg, mm, vv *uint16, n int, k *bf16Consts)
// n must be a multiple of 8.
TEXT ·stepBF16AVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	VBROADCASTSS 128(AX), Y8  // decay
	VBROADCASTSS 132(AX), Y9  // lerp coefficient
	VBROADCASTSS 136(AX), Y10 // beta2
	VBROADCASTSS 140(AX), Y11 // 1-beta2
	VBROADCASTSS 144(AX), Y12 // sign mask
	VBROADCASTSS 148(AX), Y13 // base mask
	VBROADCASTSS 152(AX), Y14 // bias_correction2_sqrt
	VBROADCASTSS 156(AX), Y15 // eps rounded to bfloat16
	XORQ BX, BX
loopb:
	CMPQ BX, CX
	JGE doneb
	LOADBF((SI)(BX*2), Y0)
	VXORPS Y12, Y0, Y0        // g
	LOADBF((DI)(BX*2), Y1)
	VMULPS Y8, Y1, Y1
	RNDBF(Y1, Y6, Y7)         // p = bf16(p * decay)
	LOADBF((R8)(BX*2), Y2)
	VSUBPS Y2, Y0, Y3
	VANDPS Y13, Y0, Y4
	VANDNPS Y2, Y13, Y5
	VORPS Y5, Y4, Y4
	VFMADD231PS Y3, Y9, Y4
	RNDBF(Y4, Y6, Y7)         // m = bf16(lerp(m, g, w))
	STOREBF(Y4, Y5, X5, (R8)(BX*2))
	LOADBF((R9)(BX*2), Y5)
	VMULPS Y10, Y5, Y5
	RNDBF(Y5, Y6, Y7)         // v = bf16(v * beta2)
	VMULPS Y11, Y0, Y3
	VFMADD231PS Y0, Y3, Y5
	RNDBF(Y5, Y6, Y7)         // v = bf16(fma((1-beta2)*g, g, v))
	STOREBF(Y5, Y3, X3, (R9)(BX*2))
	VSQRTPS Y5, Y3
	RNDBF(Y3, Y6, Y7)
	VDIVPS Y14, Y3, Y3
	RNDBF(Y3, Y6, Y7)
	VADDPS Y15, Y3, Y3
	RNDBF(Y3, Y6, Y7)         // denom
	VBROADCASTSS 160(AX), Y2
	VMULPS Y4, Y2, Y2
	VDIVPS Y3, Y2, Y2
	VADDPS Y2, Y1, Y1
	RNDBF(Y1, Y6, Y7)         // p = bf16(p + (value*m)/denom)
	STOREBF(Y1, Y2, X2, (DI)(BX*2))
	ADDQ $8, BX
	JMP loopb
doneb:
	VZEROUPPER
	RET

// The fused AdamW step (torch.optim.AdamW(fused=True) on CPU, the vector loop
// of an FMA build; see fused.go): one pass, every quantity in float32, each
// buffer rounded once when stored. k points at a vecConsts; the lanes are
// exactly fusedElement's non-tail branch with fma set.
//
// FUSED8 computes 8 lanes: Y0 = g, Y1 = p (in: loaded, out: updated, unrounded),
// Y2 = m (in), Y5 = v (in); out: Y4 = new m, Y5 = new v, Y6 = denominator.
#define FUSED8 \
	VXORPS Y12, Y0, Y0; \
	VMULPS Y8, Y1, Y1; \
	VSUBPS Y2, Y0, Y3; \
	VANDPS Y13, Y0, Y4; \
	VANDNPS Y2, Y13, Y6; \
	VORPS Y6, Y4, Y4; \
	VFMADD231PS Y3, Y9, Y4; \
	VMULPS Y10, Y5, Y5; \
	VMULPS Y11, Y0, Y6; \
	VFMADD231PS Y0, Y6, Y5; \
	VSQRTPS Y5, Y6; \
	VDIVPS Y14, Y6, Y6; \
	VADDPS Y15, Y6, Y6; \
	VBROADCASTSS 160(AX), Y7; \
	VMULPS Y4, Y7, Y7; \
	VDIVPS Y6, Y7, Y7; \
	VADDPS Y7, Y1, Y1

// FUSEDCONSTS broadcasts the step's constants (AX points at vecConsts).
#define FUSEDCONSTS \
	VBROADCASTSS 128(AX), Y8; \
	VBROADCASTSS 132(AX), Y9; \
	VBROADCASTSS 136(AX), Y10; \
	VBROADCASTSS 140(AX), Y11; \
	VBROADCASTSS 144(AX), Y12; \
	VBROADCASTSS 148(AX), Y13; \
	VBROADCASTSS 152(AX), Y14; \
	VBROADCASTSS 156(AX), Y15

// func fusedF32AVX2(pp, gg, mm, vv *float32, n int, k *vecConsts)
// n must be a multiple of 8.
TEXT ·fusedF32AVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	FUSEDCONSTS
	XORQ BX, BX
loopf:
	CMPQ BX, CX
	JGE donef
	VMOVUPS (SI)(BX*4), Y0
	VMOVUPS (DI)(BX*4), Y1
	VMOVUPS (R8)(BX*4), Y2
	VMOVUPS (R9)(BX*4), Y5
	FUSED8
	VMOVUPS Y4, (R8)(BX*4)
	VMOVUPS Y5, (R9)(BX*4)
	VMOVUPS Y1, (DI)(BX*4)
	ADDQ $8, BX
	JMP loopf
donef:
	VZEROUPPER
	RET

// func fusedBF16AVX2(pp, gg, mm, vv *uint16, n int, k *vecConsts)
// n must be a multiple of 8. Computed in float32 from the widened inputs;
// p, m and v rounded to bfloat16 once each, when stored.
TEXT ·fusedBF16AVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	FUSEDCONSTS
	XORQ BX, BX
loopfb:
	CMPQ BX, CX
	JGE donefb
	LOADBF((SI)(BX*2), Y0)
	LOADBF((DI)(BX*2), Y1)
	LOADBF((R8)(BX*2), Y2)
	LOADBF((R9)(BX*2), Y5)
	FUSED8
	RNDBF(Y4, Y2, Y3)
	STOREBF(Y4, Y2, X2, (R8)(BX*2))
	RNDBF(Y5, Y2, Y3)
	STOREBF(Y5, Y2, X2, (R9)(BX*2))
	RNDBF(Y1, Y2, Y3)
	STOREBF(Y1, Y2, X2, (DI)(BX*2))
	ADDQ $8, BX
	JMP loopfb
donefb:
	VZEROUPPER
	RET
