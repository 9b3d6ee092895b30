#include "textflag.h"
#include "prefetch_amd64.h"
#include "divide_amd64.h"

// AVX2+FMA passes of the float32 AdamW step. They perform, lane for lane, the
// same IEEE single-precision operations as torch's vectorized CPU kernels
// (see StepF32), so the results are bitwise those of the scalar Go code.
//
// The constants block k (pass1Consts, vecConsts) holds broadcastable float32
// values and masks.

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

// func pass2AVX2(pp, mm, sq *float32, n int, k *vecConsts)
TEXT ·pass2AVX2(SB), NOSPLIT, $0-40
	MOVQ pp+0(FP), DI
	MOVQ mm+8(FP), SI
	MOVQ sq+16(FP), R8
	MOVQ n+24(FP), CX
	MOVQ k+32(FP), AX
	VBROADCASTSS 152(AX), Y8  // bias_correction2_sqrt
	VBROADCASTSS 156(AX), Y9  // eps
	VBROADCASTSS 160(AX), Y10 // -step_size
	XORQ BX, BX
loop2:
	CMPQ BX, CX
	JGE done2
	VMOVUPS (R8)(BX*4), Y0
	DIVBC(Y0, Y3, Y4, Y5, Y8) // sqrt(v) / bc2s
	VADDPS Y9, Y3, Y0         // + eps
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

// LOADBF widens 8 bfloat16 values at addr to float32 lanes of x.
#define LOADBF(addr, x) \
	VPMOVZXWD addr, x; \
	VPSLLD $16, x, x

// STOREBF stores the 8 lanes of x as bfloat16: the high half of each lane,
// rounded (RBFI, RBFS or RNDBFOR; the low half is dropped).
#define STOREBF(x, t, tx, addr) \
	VPSRLD $16, x, t; \
	VPACKUSDW t, t, t; \
	VPERMQ $0x08, t, t; \
	VMOVDQU tx, addr

// RBFI rounds x to bfloat16 precision in place (round to nearest even) in
// integer operations with the masks in registers (Y11 0x10000, Y12
// 0xFFFF0000, Y13 0x7FFF): x plus 0x7FFF plus its bit 16 (added as minus the
// all-ones VPCMPEQD), low half cleared; t is clobbered. It does not make NaNs
// canonical, and needs not: inside stepBF16AVX2 every NaN has a zero low
// half (the inputs are bfloat16; an operation passes on an operand's NaN or
// makes the default one), and such a NaN comes out unchanged. RBFS is RBFI
// for a value that is stored: a NaN becomes 0x7FC0 (96(AX)), as c10::BFloat16
// stores it.
#define RBFI(x, t) \
	VPAND Y11, x, t; \
	VPADDD Y13, x, x; \
	VPCMPEQD Y11, t, t; \
	VPSUBD t, x, x; \
	VPAND Y12, x, x

#define RBFS(x, t) \
	RBFI(x, t); \
	VCMPPS $3, x, x, t; \
	VBLENDVPS t, 96(AX), x, x

// LOADEO widens the 16 bfloat16 values at addr, read as 8 32-bit words, to
// the float32 lanes of e (the even elements, from the low halves) and o (the
// odd ones, the high halves). STOREEO is its inverse for two rounded blocks
// (t clobbered).
#define LOADEO(addr, e, o) \
	VMOVDQU addr, o; \
	VPSLLD $16, o, e; \
	VPAND Y12, o, o

#define STOREEO(e, o, t, addr) \
	VPSRLD $16, e, t; \
	VPOR o, t, t; \
	VMOVDQU t, addr

// The stages of the bfloat16 single-tensor step for one block of 8 lanes (in
// the 16-element loop, the even or the odd elements) on the registers g, p,
// m (later v), t, u and the rounding temporary r, the step's constants read
// from vecConsts.wide. The operations, their operands' order and their
// roundings are StepBF16's; only products swap factors, which changes no
// bit (a NaN among them is stored as 0x7FC0 whichever operand it came from).
//
// SW3: u = bf16(lerp(m, g, w)), to be stored.
#define SW3(g, m, t, u, r) \
	VSUBPS m, g, t; \
	VANDPS 324(AX), g, u; \
	VANDPS 452(AX), m, m; \
	VORPS m, u, u; \
	VFMADD231PS 196(AX), t, u; \
	RBFS(u, r)

// SW4: v = bf16(fma((1-beta2)*g, g, bf16(v*beta2))), to be stored.
#define SW4(g, v, t, r) \
	VMULPS 228(AX), v, v; \
	RBFI(v, r); \
	VMULPS 260(AX), g, t; \
	VFMADD231PS g, t, v; \
	RBFS(v, r)

// SW5: t = the denominator.
#define SW5(v, t, r) \
	VSQRTPS v, t; \
	RBFI(t, r); \
	VDIVPS 356(AX), t, t; \
	RBFI(t, r); \
	VADDPS 388(AX), t, t; \
	RBFI(t, r)

// SW6: p = bf16(p + (value*m)/denom), to be stored (g clobbered).
#define SW6(g, p, t, u, r) \
	VMULPS 420(AX), u, g; \
	VDIVPS t, g, g; \
	VADDPS g, p, p; \
	RBFS(p, r)

// func stepBF16AVX2(pp, gg, mm, vv *uint16, n int, k *vecConsts)
// n must be a multiple of 8.
//
// 16 elements an iteration as two blocks of 8 lanes, the even and the odd
// elements (LOADEO: no shuffle), their stages interleaved. Rounding after
// every operation makes each block one long chain of dependent
// instructions, and the core's floating-point scheduler holds too few of
// them to reach the next block's independent chain on its own; written side
// by side, the two chains overlap. The roundings are integer operations
// with their masks in registers (RBFI; on Zen 3 vector shifts, float
// compares and VBLENDVPS run on two of the four FP pipes, one of them the
// divider's), and only the three stored values make their NaNs canonical.
// The step's constants are memory operands (vecConsts.wide). A last block
// of 8 runs the same stages alone (LOADBF, STOREBF).
TEXT ·stepBF16AVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	MOVQ CX, DX
	ANDQ $-16, DX
	XORQ BX, BX
	VMOVDQU 484(AX), Y11
	VMOVDQU 64(AX), Y12
	VMOVDQU 32(AX), Y13
loopb2:
	CMPQ BX, DX
	JGE tailb
	PREFETCH4(2)
	LOADEO((SI)(BX*2), Y0, Y5)
	VXORPS 292(AX), Y0, Y0
	VXORPS 292(AX), Y5, Y5
	LOADEO((DI)(BX*2), Y1, Y6)
	VMULPS 164(AX), Y1, Y1
	VMULPS 164(AX), Y6, Y6
	RBFI(Y1, Y14)
	RBFI(Y6, Y15)
	LOADEO((R8)(BX*2), Y2, Y7)
	SW3(Y0, Y2, Y3, Y4, Y14)
	SW3(Y5, Y7, Y8, Y9, Y15)
	LOADEO((R9)(BX*2), Y2, Y7)
	STOREEO(Y4, Y9, Y10, (R8)(BX*2))
	SW4(Y0, Y2, Y3, Y14)
	SW4(Y5, Y7, Y8, Y15)
	STOREEO(Y2, Y7, Y10, (R9)(BX*2))
	SW5(Y2, Y3, Y14)
	SW5(Y7, Y8, Y15)
	SW6(Y0, Y1, Y3, Y4, Y14)
	SW6(Y5, Y6, Y8, Y9, Y15)
	STOREEO(Y1, Y6, Y10, (DI)(BX*2))
	ADDQ $16, BX
	JMP loopb2
tailb:
	CMPQ BX, CX
	JGE doneb
	LOADBF((SI)(BX*2), Y0)
	VXORPS 292(AX), Y0, Y0
	LOADBF((DI)(BX*2), Y1)
	VMULPS 164(AX), Y1, Y1
	RBFI(Y1, Y14)
	LOADBF((R8)(BX*2), Y2)
	SW3(Y0, Y2, Y3, Y4, Y14)
	LOADBF((R9)(BX*2), Y2)
	STOREBF(Y4, Y5, X5, (R8)(BX*2))
	SW4(Y0, Y2, Y3, Y14)
	STOREBF(Y2, Y5, X5, (R9)(BX*2))
	SW5(Y2, Y3, Y14)
	SW6(Y0, Y1, Y3, Y4, Y14)
	STOREBF(Y1, Y5, X5, (DI)(BX*2))
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
// It divides by bc2s without the divider (DIVBC, divide_amd64.h: 0.52 ->
// 0.38 ns an element on one core in L2, Intel, 2026-12-02).
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
	DIVBC(Y6, Y0, Y3, Y7, Y14); \
	VADDPS Y15, Y0, Y6; \
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
	PREFETCH4(4)
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

// RNDBFOR rounds the float32 lanes of x to bfloat16 for a store by
// fusedBF16AVX2, into t: the bfloat16 in the high half of each lane (the low
// half is garbage), a NaN as 0xFFFF (the fused kernels' vector NaN); c is
// clobbered. Round to nearest even in integer operations with the masks in
// registers: x plus 0x7FFF plus its bit 16 (added as minus the all-ones
// VPCMPEQD), a NaN (|x| above the infinity pattern, a signed integer
// compare) ORed to all ones. Y11 0x10000, Y13 0x7FFF, Y14 0x7FFFFFFF, Y15
// 0x7F800000.
//
// Why not the rounding this replaced (a shift for bit 16, three masks read
// from memory, VCMPPS and VBLENDVPS for the NaN): on Zen 3 (AMD's
// optimization guide for family 19h, LLVM's znver3 model) vector shifts,
// shuffles, float compares and VBLENDVPS run on two of the four FP pipes,
// one of them the divider's. This loop with that rounding and the
// shift-and-shuffle widening and narrowing ran 1.48-1.56 ns an element on
// one core in L2, this one 1.25-1.35 (BenchmarkFused-style loop over 16K
// elements, 4 interleaved runs, 2026-12-01).
#define RNDBFOR(x, t, c) \
	VPAND Y11, x, t; \
	VPCMPEQD Y11, t, t; \
	VPSUBD t, x, t; \
	VPADDD Y13, t, t; \
	VPAND Y14, x, c; \
	VPCMPGTD Y15, c, c; \
	VPOR c, t, t

// FUSEDW is FUSED8 with the constants read from vecConsts.wide (AX) instead
// of registers: g, p, m and v in; p (updated, unrounded), mo (new m) and v
// out; g, t3, t6 and t7 clobbered. The operations, their order and their
// rounding are FUSED8's; only products swap factors, which changes no bit (a
// NaN among them is stored as 0xFFFF whichever operand it came from). It
// divides by bc2s with VDIVPS, not DIVBC: this loop is bound by its other
// operations (the roundings), and DIVBC's made it slower (0.67 -> 0.81 ns an
// element on one core in L2, Intel, 2026-12-02).
#define FUSEDW(g, p, m, v, t3, mo, t6, t7) \
	VXORPS 292(AX), g, g; \
	VMULPS 164(AX), p, p; \
	VSUBPS m, g, t3; \
	VANDPS 324(AX), g, mo; \
	VANDPS 452(AX), m, t6; \
	VORPS t6, mo, mo; \
	VFMADD231PS 196(AX), t3, mo; \
	VMULPS 228(AX), v, v; \
	VMULPS 260(AX), g, t6; \
	VFMADD231PS g, t6, v; \
	VSQRTPS v, t6; \
	VDIVPS 356(AX), t6, t6; \
	VADDPS 388(AX), t6, t6; \
	VMULPS 420(AX), mo, t7; \
	VDIVPS t6, t7, t7; \
	VADDPS t7, p, p

// FWLOADLO and FWLOADHI widen the even (times 0x10000: VPMULLD) or odd
// (masked) elements of the 16 bfloat16 values at addr to float32 lanes of x.
#define FWLOADLO(addr, x) \
	VMOVDQU addr, x; \
	VPMULLD Y11, x, x

#define FWLOADHI(addr, x) \
	VMOVDQU addr, x; \
	VPAND Y12, x, x

// FWHALF widens g, p, m and v of one half with load (FWLOADLO or FWLOADHI)
// and computes it: p, m and v out in Y1, Y4 and Y5.
#define FWHALF(load) \
	load((SI)(BX*2), Y0); \
	load((DI)(BX*2), Y1); \
	load((R8)(BX*2), Y2); \
	load((R9)(BX*2), Y5); \
	FUSEDW(Y0, Y1, Y2, Y5, Y3, Y4, Y6, Y7)

// FWKEEP rounds the even block's x into e and moves each bfloat16 down to
// the low half of its lane (VPMADDWD: times 1 in the high word, 0 in the
// low), where FWSTORE merges it with the odd block's.
#define FWKEEP(x, e) \
	RNDBFOR(x, e, Y3); \
	VPMADDWD Y11, e, e

// FWSTORE rounds the odd block's x, merges it with the even block's (e,
// already moved down by VPMADDWD) and stores the 16 elements at addr.
#define FWSTORE(x, e, addr) \
	RNDBFOR(x, Y3, Y6); \
	VPBLENDW $0xAA, Y3, e, e; \
	VMOVDQU e, addr

// func fusedBF16AVX2(pp, gg, mm, vv *uint16, n int, k *vecConsts)
// n must be a multiple of 8. Computed in float32 from the widened inputs;
// p, m and v rounded to bfloat16 once each, when stored.
//
// 16 elements an iteration with no shuffle: 32 bytes of bfloat16 read as 8
// 32-bit words hold the even elements in their low halves and the odd ones
// in their high halves. Each half is computed as 8 float32 lanes; stored, the
// even lanes' rounded high halves are moved down by VPMADDWD (times 1 in the
// high word, 0 in the low) and merged with the odd lanes' by VPBLENDW. The
// rounding's masks stay in registers and the step's constants are memory
// operands (each is used once a half): masks read from memory cost more than
// their count says (measured without the arithmetic: 0.84 ns an element with
// the 24 masks a 16 elements from memory, 0.51 from registers). A last block
// of 8 runs one half's code alone (LOADBF, FUSEDW, RNDBFOR, STOREBF).
TEXT ·fusedBF16AVX2(SB), NOSPLIT, $0-48
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ k+40(FP), AX
	MOVQ CX, DX
	ANDQ $-16, DX
	XORQ BX, BX
	VMOVDQU 484(AX), Y11
	VMOVDQU 64(AX), Y12
	VMOVDQU 32(AX), Y13
	VMOVDQU 516(AX), Y14
	VMOVDQU 548(AX), Y15
loopfw:
	CMPQ BX, DX
	JGE tailfb
	PREFETCH4(2)
	FWHALF(FWLOADLO)
	FWKEEP(Y1, Y8)
	FWKEEP(Y4, Y9)
	FWKEEP(Y5, Y10)
	FWHALF(FWLOADHI)
	FWSTORE(Y4, Y9, (R8)(BX*2))
	FWSTORE(Y5, Y10, (R9)(BX*2))
	FWSTORE(Y1, Y8, (DI)(BX*2))
	ADDQ $16, BX
	JMP loopfw
tailfb:
	CMPQ BX, CX
	JGE donefb
	LOADBF((SI)(BX*2), Y0)
	LOADBF((DI)(BX*2), Y1)
	LOADBF((R8)(BX*2), Y2)
	LOADBF((R9)(BX*2), Y5)
	FUSEDW(Y0, Y1, Y2, Y5, Y3, Y4, Y6, Y7)
	RNDBFOR(Y4, Y8, Y9)
	STOREBF(Y8, Y9, X9, (R8)(BX*2))
	RNDBFOR(Y5, Y8, Y9)
	STOREBF(Y8, Y9, X9, (R9)(BX*2))
	RNDBFOR(Y1, Y8, Y9)
	STOREBF(Y8, Y9, X9, (DI)(BX*2))
donefb:
	VZEROUPPER
	RET
