#include "textflag.h"

// func streamAVX2(pp, gg, mm, vv *float32, n int)
// AdamW's memory traffic without its arithmetic: read p, g, m, v and write
// p, m, v, 8 floats at a time (n a multiple of 8), one add per stored vector
// so that every store depends on its loads. It prefetches its four input
// streams 2 KiB ahead as the engine's kernels do (optimizer/prefetch_amd64.h);
// on an Intel Xeon that changed nothing here (46-48 GB/s either way, 2
// cores): a loop this short keeps enough loads in flight by itself.
TEXT ·streamAVX2(SB), NOSPLIT, $0-40
	MOVQ pp+0(FP), DI
	MOVQ gg+8(FP), SI
	MOVQ mm+16(FP), R8
	MOVQ vv+24(FP), R9
	MOVQ n+32(FP), CX
	XORQ BX, BX
loop:
	CMPQ BX, CX
	JGE done
	PREFETCHT0 2048(SI)(BX*4)
	PREFETCHT0 2048(DI)(BX*4)
	PREFETCHT0 2048(R8)(BX*4)
	PREFETCHT0 2048(R9)(BX*4)
	VMOVUPS (SI)(BX*4), Y0
	VADDPS (DI)(BX*4), Y0, Y1
	VADDPS (R8)(BX*4), Y0, Y2
	VADDPS (R9)(BX*4), Y0, Y3
	VMOVUPS Y1, (DI)(BX*4)
	VMOVUPS Y2, (R8)(BX*4)
	VMOVUPS Y3, (R9)(BX*4)
	ADDQ $8, BX
	JMP loop
done:
	VZEROUPPER
	RET
