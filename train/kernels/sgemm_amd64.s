#include "textflag.h"

// func kern6x16(kc int, a *float32, ars, aps int, b *float32, bps int, c *float32, ldc int, acc bool)
//
// Computes, for a 6x16 tile of C (row i at c + i*ldc elements), the sums
// over p < kc of a[i*ars + p*aps] * b[p*bps + j]: one FMA chain per element,
// p in order, from zero; then adds each sum to C (acc) or stores it. a is a
// panel of op(A) in place (ars = lda, aps = 1, or ars = 1, aps = lda) or
// packed (ars = 1, aps = 6); b a panel of op(B) in place (bps = ldb) or
// packed (bps = 16).
TEXT ·kern6x16(SB), NOSPLIT, $0-65
	MOVQ kc+0(FP), CX
	MOVQ a+8(FP), SI
	MOVQ ars+16(FP), R8
	SHLQ $2, R8
	MOVQ aps+24(FP), R9
	SHLQ $2, R9
	MOVQ b+32(FP), DI
	MOVQ bps+40(FP), R12
	SHLQ $2, R12
	MOVQ c+48(FP), DX
	MOVQ ldc+56(FP), R11
	SHLQ $2, R11
	LEAQ (SI)(R8*2), R10
	ADDQ R8, R10 // R10 = row 3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	VXORPS Y8, Y8, Y8
	VXORPS Y9, Y9, Y9
	VXORPS Y10, Y10, Y10
	VXORPS Y11, Y11, Y11
	VXORPS Y12, Y12, Y12
	VXORPS Y13, Y13, Y13
	VXORPS Y14, Y14, Y14
	VXORPS Y15, Y15, Y15
	TESTQ CX, CX
	JZ    done

loop:
	VMOVUPS      (DI), Y0
	VMOVUPS      32(DI), Y1
	VBROADCASTSS (SI), Y2
	VFMADD231PS  Y0, Y2, Y4
	VFMADD231PS  Y1, Y2, Y5
	VBROADCASTSS (SI)(R8*1), Y3
	VFMADD231PS  Y0, Y3, Y6
	VFMADD231PS  Y1, Y3, Y7
	VBROADCASTSS (SI)(R8*2), Y2
	VFMADD231PS  Y0, Y2, Y8
	VFMADD231PS  Y1, Y2, Y9
	VBROADCASTSS (R10), Y3
	VFMADD231PS  Y0, Y3, Y10
	VFMADD231PS  Y1, Y3, Y11
	VBROADCASTSS (R10)(R8*1), Y2
	VFMADD231PS  Y0, Y2, Y12
	VFMADD231PS  Y1, Y2, Y13
	VBROADCASTSS (R10)(R8*2), Y3
	VFMADD231PS  Y0, Y3, Y14
	VFMADD231PS  Y1, Y3, Y15
	ADDQ         R9, SI
	ADDQ         R9, R10
	ADDQ         R12, DI
	DECQ         CX
	JNZ          loop

done:
	MOVBQZX acc+64(FP), AX
	TESTQ   AX, AX
	JZ      store
	VADDPS  (DX), Y4, Y4
	VADDPS  32(DX), Y5, Y5
	VMOVUPS Y4, (DX)
	VMOVUPS Y5, 32(DX)
	ADDQ    R11, DX
	VADDPS  (DX), Y6, Y6
	VADDPS  32(DX), Y7, Y7
	VMOVUPS Y6, (DX)
	VMOVUPS Y7, 32(DX)
	ADDQ    R11, DX
	VADDPS  (DX), Y8, Y8
	VADDPS  32(DX), Y9, Y9
	VMOVUPS Y8, (DX)
	VMOVUPS Y9, 32(DX)
	ADDQ    R11, DX
	VADDPS  (DX), Y10, Y10
	VADDPS  32(DX), Y11, Y11
	VMOVUPS Y10, (DX)
	VMOVUPS Y11, 32(DX)
	ADDQ    R11, DX
	VADDPS  (DX), Y12, Y12
	VADDPS  32(DX), Y13, Y13
	VMOVUPS Y12, (DX)
	VMOVUPS Y13, 32(DX)
	ADDQ    R11, DX
	VADDPS  (DX), Y14, Y14
	VADDPS  32(DX), Y15, Y15
	VMOVUPS Y14, (DX)
	VMOVUPS Y15, 32(DX)
	VZEROUPPER
	RET

store:
	VMOVUPS Y4, (DX)
	VMOVUPS Y5, 32(DX)
	ADDQ    R11, DX
	VMOVUPS Y6, (DX)
	VMOVUPS Y7, 32(DX)
	ADDQ    R11, DX
	VMOVUPS Y8, (DX)
	VMOVUPS Y9, 32(DX)
	ADDQ    R11, DX
	VMOVUPS Y10, (DX)
	VMOVUPS Y11, 32(DX)
	ADDQ    R11, DX
	VMOVUPS Y12, (DX)
	VMOVUPS Y13, 32(DX)
	ADDQ    R11, DX
	VMOVUPS Y14, (DX)
	VMOVUPS Y15, 32(DX)
	VZEROUPPER
	RET
