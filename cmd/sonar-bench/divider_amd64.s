#include "textflag.h"

// func dividerYMM(n int, x *float32)
// n iterations of what every AdamW element needs of the core's divider,
// one square root and two divisions, for 2x8 lanes: two independent groups,
// so the loop runs at the divider's throughput, not its latency.
TEXT ·dividerYMM(SB), NOSPLIT, $0-16
	MOVQ n+0(FP), CX
	MOVQ x+8(FP), AX
	VMOVUPS (AX), Y0
	VMOVUPS 4(AX), Y1
	VMOVUPS 8(AX), Y2
	VMOVUPS 12(AX), Y3
	VMOVUPS 16(AX), Y4
loopy:
	VSQRTPS Y0, Y5
	VDIVPS Y1, Y0, Y6
	VDIVPS Y2, Y0, Y7
	VSQRTPS Y1, Y8
	VDIVPS Y3, Y1, Y9
	VDIVPS Y4, Y1, Y10
	DECQ CX
	JNZ loopy
	VZEROUPPER
	RET

// func dividerZMM(n int, x *float32)
// dividerYMM for 2x16 lanes (AVX-512F).
TEXT ·dividerZMM(SB), NOSPLIT, $0-16
	MOVQ n+0(FP), CX
	MOVQ x+8(FP), AX
	VMOVUPS (AX), Z0
	VMOVUPS 4(AX), Z1
	VMOVUPS 8(AX), Z2
	VMOVUPS 12(AX), Z3
	VMOVUPS 16(AX), Z4
loopz:
	VSQRTPS Z0, Z5
	VDIVPS Z1, Z0, Z6
	VDIVPS Z2, Z0, Z7
	VSQRTPS Z1, Z8
	VDIVPS Z3, Z1, Z9
	VDIVPS Z4, Z1, Z10
	DECQ CX
	JNZ loopz
	VZEROUPPER
	RET
