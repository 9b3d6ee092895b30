package optimizer

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
)

// The macros ZBF16PAIRCVT and ZBF16QUADCVT (bf16cvt_amd64.h), the vector
// loop of the AVX-512 BF16 bfloat16 step, and ZBF16PAIRTBL and
// ZBF16QUADTBL, the same loop with the denominator's first two stages
// looked up (VBMI), are generated here: one pair's instructions are written
// once (bf16PairSteps), the quad alternates two pairs' on other registers,
// and every VCVTNE2PS2BF16, which Go's assembler does not know, is encoded
// from its registers. TestBF16CVTGenerated fails when the file differs from
// what this code writes; -update-bf16cvt rewrites it.
var updateBF16CVT = flag.Bool("update-bf16cvt", false, "rewrite bf16cvt_amd64.h from bf16PairSteps")

const bf16CVTFile = "bf16cvt_amd64.h"

// bf16Regs names the registers of one pair: g (gradient), v (exp_avg_sq),
// t (the denominator's chain), p (parameter), a (exp_avg), their two blocks
// each; u a temporary; r the VCVT2s' results; sm, sv the new exp_avg and
// exp_avg_sq in memory order; off the pair's byte offset from BX's
// elements; zk the mask its checks clear; km the mask of the table
// lookup's second half.
type bf16Regs struct {
	g0, g1, v0, v1, t0, t1, p0, p1, a0, a1, u, r, sm, sv int
	off                                                  string
	zk, km                                               string
}

var (
	bf16RegsX = bf16Regs{g0: 0, g1: 5, v0: 2, v1: 7, t0: 3, t1: 22, p0: 1, p1: 6, a0: 4, a1: 23, u: 24, r: 29, sm: 30, sv: 31, zk: "K1", km: "K5"}
	bf16RegsY = bf16Regs{g0: 8, g1: 9, v0: 10, v1: 11, t0: 12, t1: 14, p0: 17, p1: 18, a0: 20, a1: 21, u: 19, r: 15, sm: 27, sv: 16, off: "64", zk: "K2", km: "K6"}
)

// vcvt2 encodes VCVTNE2PS2BF16 dst, src1, src2 (EVEX.512.F2.0F38.W0 72 /r):
// dst's words 0-15 are src2's lanes rounded, 16-31 src1's.
func vcvt2(dst, src1, src2 int) string {
	inv := func(b int) int { return b ^ 1 }
	p0 := inv(dst>>3&1)<<7 | inv(src2>>4&1)<<6 | inv(src2>>3&1)<<5 | inv(dst>>4&1)<<4 | 2
	p1 := (^src1&15)<<3 | 1<<2 | 3
	p2 := 2<<5 | inv(src1>>4&1)<<3
	modrm := 0xC0 | (dst&7)<<3 | src2&7
	var b []string
	for _, x := range []int{0x62, p0, p1, p2, 0x72, modrm} {
		b = append(b, fmt.Sprintf("BYTE $0x%02x", x))
	}
	return fmt.Sprintf("%s /* VCVTNE2PS2BF16 Z%d, Z%d, Z%d */", strings.Join(b, "; "), src2, src1, dst)
}

// bf16PairSteps is one pair's instructions in program order (the order of
// ZBF16PAIRCVT's comment in kernel_avx512_amd64.s): exp_avg_sq's chain
// first, as it leads to the divider. first: this pair's NaN check starts
// K3 (else it adds to it). table: the rounded square root divided by
// bias_correction2_sqrt and rounded comes from the step's table
// (ZBF16PAIRTBL's comment) instead of VSQRTPS, VDIVPS and two roundings.
func bf16PairSteps(r bf16Regs, first, table bool) []string {
	z := func(n int) string { return fmt.Sprintf("Z%d", n) }
	var s []string
	add := func(f string, a ...any) { s = append(s, fmt.Sprintf(f, a...)) }
	unpk := func(src string, a, b int) {
		add("VPUNPCKLWD %s, Z13, %s", src, z(a))
		add("VPUNPCKHWD %s, Z13, %s", src, z(b))
	}
	check := func(x int, start bool) {
		if start {
			add("VPTESTMW Z28, %s, %s", z(x), r.zk)
		} else {
			add("VPTESTMW Z28, %s, %s, %s", z(x), r.zk, r.zk)
		}
	}
	both := func(f string, x0, x1 int) { add(f, z(x0), z(x0)); add(f, z(x1), z(x1)) }
	mem := func(base string) string { return r.off + "(" + base + ")(BX*2)" }

	unpk(mem("SI"), r.g0, r.g1) // g, order 1
	both("VPXORD.BCST 144(AX), %s, %s", r.g0, r.g1)
	add("VPERMQ %s, Z25, %s", mem("R9"), z(r.r)) // v, order 0
	unpk(z(r.r), r.v0, r.v1)
	both("VMULPS.BCST 136(AX), %s, %s", r.v0, r.v1) // v*beta2
	s = append(s, vcvt2(r.r, r.v1, r.v0))
	check(r.r, true)
	unpk(z(r.r), r.v0, r.v1) // order 1
	add("VMULPS.BCST 140(AX), %s, %s", z(r.g0), z(r.t0))
	add("VFMADD231PS %s, %s, %s", z(r.g0), z(r.t0), z(r.v0))
	add("VMULPS.BCST 140(AX), %s, %s", z(r.g1), z(r.t1))
	add("VFMADD231PS %s, %s, %s", z(r.g1), z(r.t1), z(r.v1)) // new exp_avg_sq
	s = append(s, vcvt2(r.sv, r.v1, r.v0))
	if table {
		// The new exp_avg_sq must be a positive normal number: a word w
		// with w+0x80 > 0xFF as a signed 16-bit integer.
		add("VPADDW bf16W0080<>(SB), %s, %s", z(r.sv), z(r.v0))
		add("VPCMPW $6, bf16W00FF<>(SB), %s, %s, %s", z(r.v0), r.zk, r.zk)
		add("VPERMQ %s, Z25, %s", z(r.sv), z(r.sv)) // memory order
		// Byte i of the table for each word's low byte (the exponent's
		// low bit and the mantissa), odd bytes zero (K7).
		add("VMOVDQU64 612(AX), %s", z(r.t0))
		add("VPERMT2B.Z 676(AX), %s, K7, %s", z(r.sv), z(r.t0))
		add("VMOVDQU64 740(AX), %s", z(r.v0))
		add("VPERMT2B.Z 804(AX), %s, K7, %s", z(r.sv), z(r.v0))
		add("VPMOVB2M %s, %s", z(r.sv), r.km)
		add("VPBLENDMB %s, %s, %s, %s", z(r.v0), z(r.t0), r.km, z(r.t0))
		// The exponent: (w + 0x3F80 + 256*q) / 2, its low 7 bits cleared.
		add("VPAVGW 868(AX), %s, %s", z(r.sv), z(r.v1))
		add("VPANDD.BCST bf16WFF80<>(SB), %s, %s", z(r.v1), z(r.v1))
		add("VPADDW %s, %s, %s", z(r.v1), z(r.t0), z(r.t0)) // the quotient rounded, memory order
	} else {
		check(r.sv, false)
		unpk(z(r.sv), r.v0, r.v1) // order 2
		add("VSQRTPS %s, %s", z(r.v0), z(r.t0))
		add("VSQRTPS %s, %s", z(r.v1), z(r.t1))
		add("VPERMQ %s, Z25, %s", z(r.sv), z(r.sv))
	}
	unpk(mem("DI"), r.p0, r.p1)                     // p, order 1
	both("VMULPS.BCST 128(AX), %s, %s", r.p0, r.p1) // p*decay
	s = append(s, vcvt2(r.r, r.p1, r.p0))
	check(r.r, false)
	unpk(z(r.r), r.p0, r.p1)    // order 2
	unpk(mem("R8"), r.v0, r.v1) // m, order 1
	for _, b := range [][3]int{{r.v0, r.g0, r.a0}, {r.v1, r.g1, r.a1}} {
		add("VSUBPS %s, %s, %s", z(b[0]), z(b[1]), z(r.u))
		add("VPBLENDMD %s, %s, K4, %s", z(b[1]), z(b[0]), z(b[2]))
		add("VFMADD231PS.BCST 132(AX), %s, %s", z(r.u), z(b[2])) // the lerp: new exp_avg
	}
	s = append(s, vcvt2(r.sm, r.a1, r.a0))
	check(r.sm, false)
	unpk(z(r.sm), r.a0, r.a1) // order 2
	add("VPERMQ %s, Z25, %s", z(r.sm), z(r.sm))
	if table {
		add("VPUNPCKHWD %s, Z13, %s", z(r.t0), z(r.t1))
		add("VPUNPCKLWD %s, Z13, %s", z(r.t0), z(r.t0)) // order 1
	} else {
		s = append(s, vcvt2(r.r, r.t1, r.t0))
		unpk(z(r.r), r.t0, r.t1)                        // the root rounded, order 0
		both("VDIVPS.BCST 152(AX), %s, %s", r.t0, r.t1) // / bias_correction2_sqrt
		s = append(s, vcvt2(r.r, r.t1, r.t0))
		unpk(z(r.r), r.t0, r.t1) // order 1
	}
	both("VADDPS.BCST 156(AX), %s, %s", r.t0, r.t1) // + eps
	s = append(s, vcvt2(r.r, r.t1, r.t0))
	unpk(z(r.r), r.t0, r.t1) // the denominator, order 2
	for _, b := range [][4]int{{r.a0, r.g0, r.t0, r.p0}, {r.a1, r.g1, r.t1, r.p1}} {
		add("VMULPS.BCST 160(AX), %s, %s", z(b[0]), z(b[1]))
		add("VDIVPS %s, %s, %s", z(b[2]), z(b[1]), z(b[1]))
		add("VADDPS %s, %s, %s", z(b[1]), z(b[3]), z(b[3])) // the new parameter
	}
	if first {
		add("VCMPPS $7, %s, %s, K3", z(r.p0), z(r.p0))
	} else {
		add("VCMPPS $7, %s, %s, K3, K3", z(r.p0), z(r.p0))
	}
	add("VCMPPS $7, %s, %s, K3, K3", z(r.p1), z(r.p1))
	s = append(s, vcvt2(r.r, r.p1, r.p0))
	check(r.r, false)
	add("VPERMQ %s, Z26, %s", z(r.r), z(r.r))
	return s
}

// genBF16CVT is the text of bf16cvt_amd64.h.
func genBF16CVT() string {
	macro := func(name string, lines []string) string {
		return "#define " + name + " \\\n\t" + strings.Join(lines, "; \\\n\t") + "\n"
	}
	text := "// Code generated by TestBF16CVTGenerated (bf16cvt_gen_amd64_test.go, go test\n" +
		"// -run BF16CVTGenerated -update-bf16cvt); DO NOT EDIT.\n"
	for _, table := range []bool{false, true} {
		x, y := bf16PairSteps(bf16RegsX, true, table), bf16PairSteps(bf16RegsY, false, table)
		var quad []string
		for i := range x { // X's first NaN check comes before Y's
			quad = append(quad, x[i], y[i])
		}
		kind := "CVT"
		if table {
			kind = "TBL"
		}
		text += "\n// ZBF16PAIR" + kind + " steps the 32 elements at BX (kernel_avx512_amd64.s).\n" +
			macro("ZBF16PAIR"+kind, x) +
			"\n// ZBF16QUAD" + kind + " steps the 64 elements at BX as two pairs whose instructions\n" +
			"// alternate (kernel_avx512_amd64.s).\n" +
			macro("ZBF16QUAD"+kind, quad)
	}
	return text
}

func TestBF16CVTGenerated(t *testing.T) {
	want := genBF16CVT()
	if *updateBF16CVT {
		if err := os.WriteFile(bf16CVTFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(bf16CVTFile)
	if os.IsNotExist(err) {
		// A test binary run away from the source tree (make test-avx512,
		// scripts/gpu-check); in the tree the build needs the file.
		t.Skipf("%s not here: not in the source tree", bf16CVTFile)
	}
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("%s differs from what bf16PairSteps generates: go test ./optimizer -run BF16CVTGenerated -update-bf16cvt", bf16CVTFile)
	}
}

// TestVCVT2Encoding holds vcvt2 to the fused kernel's three hand-written
// VCVT2s (kernel_avx512_amd64.s), which objdump decodes as those
// instructions.
func TestVCVT2Encoding(t *testing.T) {
	for _, c := range []struct {
		dst, src1, src2 int
		want            string
	}{
		{30, 27, 4, "62 62 27 40 72 f4"},
		{30, 25, 5, "62 62 37 40 72 f5"},
		{30, 23, 1, "62 62 47 40 72 f1"},
	} {
		got := vcvt2(c.dst, c.src1, c.src2)
		got = strings.NewReplacer("BYTE $0x", "", ";", "").Replace(got[:strings.Index(got, " /*")])
		if got != c.want {
			t.Errorf("vcvt2(%d, %d, %d) = %s, want %s", c.dst, c.src1, c.src2, got, c.want)
		}
	}
}
