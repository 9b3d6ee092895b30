#include "textflag.h"

// Constants of exp32, each repeated 8 times (one YMM register).
DATA expc<>+0(SB)/4, $0x42b17217 // hi
DATA expc<>+4(SB)/4, $0x42b17217 // hi
DATA expc<>+8(SB)/4, $0x42b17217 // hi
DATA expc<>+12(SB)/4, $0x42b17217 // hi
DATA expc<>+16(SB)/4, $0x42b17217 // hi
DATA expc<>+20(SB)/4, $0x42b17217 // hi
DATA expc<>+24(SB)/4, $0x42b17217 // hi
DATA expc<>+28(SB)/4, $0x42b17217 // hi
DATA expc<>+32(SB)/4, $0xc2aeac4f // lo
DATA expc<>+36(SB)/4, $0xc2aeac4f // lo
DATA expc<>+40(SB)/4, $0xc2aeac4f // lo
DATA expc<>+44(SB)/4, $0xc2aeac4f // lo
DATA expc<>+48(SB)/4, $0xc2aeac4f // lo
DATA expc<>+52(SB)/4, $0xc2aeac4f // lo
DATA expc<>+56(SB)/4, $0xc2aeac4f // lo
DATA expc<>+60(SB)/4, $0xc2aeac4f // lo
DATA expc<>+64(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+68(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+72(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+76(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+80(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+84(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+88(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+92(SB)/4, $0x3fb8aa3b // log2e
DATA expc<>+96(SB)/4, $0x3f000000 // half
DATA expc<>+100(SB)/4, $0x3f000000 // half
DATA expc<>+104(SB)/4, $0x3f000000 // half
DATA expc<>+108(SB)/4, $0x3f000000 // half
DATA expc<>+112(SB)/4, $0x3f000000 // half
DATA expc<>+116(SB)/4, $0x3f000000 // half
DATA expc<>+120(SB)/4, $0x3f000000 // half
DATA expc<>+124(SB)/4, $0x3f000000 // half
DATA expc<>+128(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+132(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+136(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+140(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+144(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+148(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+152(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+156(SB)/4, $0x3f318000 // ln2hi
DATA expc<>+160(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+164(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+168(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+172(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+176(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+180(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+184(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+188(SB)/4, $0xb95e8083 // ln2lo
DATA expc<>+192(SB)/4, $0x39506967 // c0
DATA expc<>+196(SB)/4, $0x39506967 // c0
DATA expc<>+200(SB)/4, $0x39506967 // c0
DATA expc<>+204(SB)/4, $0x39506967 // c0
DATA expc<>+208(SB)/4, $0x39506967 // c0
DATA expc<>+212(SB)/4, $0x39506967 // c0
DATA expc<>+216(SB)/4, $0x39506967 // c0
DATA expc<>+220(SB)/4, $0x39506967 // c0
DATA expc<>+224(SB)/4, $0x3ab743ce // c1
DATA expc<>+228(SB)/4, $0x3ab743ce // c1
DATA expc<>+232(SB)/4, $0x3ab743ce // c1
DATA expc<>+236(SB)/4, $0x3ab743ce // c1
DATA expc<>+240(SB)/4, $0x3ab743ce // c1
DATA expc<>+244(SB)/4, $0x3ab743ce // c1
DATA expc<>+248(SB)/4, $0x3ab743ce // c1
DATA expc<>+252(SB)/4, $0x3ab743ce // c1
DATA expc<>+256(SB)/4, $0x3c088908 // c2
DATA expc<>+260(SB)/4, $0x3c088908 // c2
DATA expc<>+264(SB)/4, $0x3c088908 // c2
DATA expc<>+268(SB)/4, $0x3c088908 // c2
DATA expc<>+272(SB)/4, $0x3c088908 // c2
DATA expc<>+276(SB)/4, $0x3c088908 // c2
DATA expc<>+280(SB)/4, $0x3c088908 // c2
DATA expc<>+284(SB)/4, $0x3c088908 // c2
DATA expc<>+288(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+292(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+296(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+300(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+304(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+308(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+312(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+316(SB)/4, $0x3d2aa9c1 // c3
DATA expc<>+320(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+324(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+328(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+332(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+336(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+340(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+344(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+348(SB)/4, $0x3e2aaaaa // c4
DATA expc<>+352(SB)/4, $0x3f000000 // c5
DATA expc<>+356(SB)/4, $0x3f000000 // c5
DATA expc<>+360(SB)/4, $0x3f000000 // c5
DATA expc<>+364(SB)/4, $0x3f000000 // c5
DATA expc<>+368(SB)/4, $0x3f000000 // c5
DATA expc<>+372(SB)/4, $0x3f000000 // c5
DATA expc<>+376(SB)/4, $0x3f000000 // c5
DATA expc<>+380(SB)/4, $0x3f000000 // c5
DATA expc<>+384(SB)/4, $0x3f800000 // one
DATA expc<>+388(SB)/4, $0x3f800000 // one
DATA expc<>+392(SB)/4, $0x3f800000 // one
DATA expc<>+396(SB)/4, $0x3f800000 // one
DATA expc<>+400(SB)/4, $0x3f800000 // one
DATA expc<>+404(SB)/4, $0x3f800000 // one
DATA expc<>+408(SB)/4, $0x3f800000 // one
DATA expc<>+412(SB)/4, $0x3f800000 // one
DATA expc<>+416(SB)/4, $127 // exponent bias
DATA expc<>+420(SB)/4, $127 // exponent bias
DATA expc<>+424(SB)/4, $127 // exponent bias
DATA expc<>+428(SB)/4, $127 // exponent bias
DATA expc<>+432(SB)/4, $127 // exponent bias
DATA expc<>+436(SB)/4, $127 // exponent bias
DATA expc<>+440(SB)/4, $127 // exponent bias
DATA expc<>+444(SB)/4, $127 // exponent bias
GLOBL expc<>(SB), RODATA|NOPTR, $448

// func expShift8(dst, src *float32, n int, shift float32)
//
// dst[i] = e^(src[i] - shift) for i < n (a multiple of 8), 8 at a time, the
// arithmetic of exp32 with fused multiply-adds. dst may be src.
TEXT ·expShift8(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSS shift+24(FP), Y15
	SHRQ $3, CX
	JZ   done

loop:
	VMOVUPS (SI), Y0
	VSUBPS Y15, Y0, Y0
	VMINPS expc<>+0(SB), Y0, Y0
	VMAXPS expc<>+32(SB), Y0, Y0
	VMULPS expc<>+64(SB), Y0, Y1
	VADDPS expc<>+96(SB), Y1, Y1
	VROUNDPS $1, Y1, Y1 // n = floor(x log2e + 1/2)
	VFNMADD231PS expc<>+128(SB), Y1, Y0 // r = x - n ln2hi
	VFNMADD231PS expc<>+160(SB), Y1, Y0 // r -= n ln2lo
	VMOVUPS expc<>+192(SB), Y2
	VFMADD213PS expc<>+224(SB), Y0, Y2
	VFMADD213PS expc<>+256(SB), Y0, Y2
	VFMADD213PS expc<>+288(SB), Y0, Y2
	VFMADD213PS expc<>+320(SB), Y0, Y2
	VFMADD213PS expc<>+352(SB), Y0, Y2
	VMULPS Y0, Y0, Y3
	VFMADD213PS Y0, Y3, Y2 // p r^2 + r
	VADDPS expc<>+384(SB), Y2, Y2
	VCVTPS2DQ Y1, Y1
	VPADDD expc<>+416(SB), Y1, Y1
	VPSLLD $23, Y1, Y1 // 2^n
	VMULPS Y1, Y2, Y2
	VMOVUPS Y2, (DI)
	ADDQ $32, SI
	ADDQ $32, DI
	DECQ CX
	JNZ  loop

done:
	VZEROUPPER
	RET
