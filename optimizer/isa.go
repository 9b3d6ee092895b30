package optimizer

import "fmt"

// ISA is the vector instruction set the element kernels run on. Every level
// performs the same IEEE operations lane for lane, so they differ in speed
// only: the tests compare each level the CPU has with the portable Go code.
type ISA int

const (
	// ISAGo is the portable Go code (every architecture).
	ISAGo ISA = iota
	// ISAAVX2 is AVX2 with FMA, 8 float32 lanes (amd64).
	ISAAVX2
	// ISAAVX512 is AVX-512 Foundation, 16 float32 lanes (amd64); what is left
	// of a block below 16 elements runs on AVX2.
	ISAAVX512
	// ISAAVX512BF16 is ISAAVX512 with the AVX-512 BF16, BW and DQ extensions
	// (amd64): the fused bfloat16 kernel narrows its stores with
	// VCVTNE2PS2BF16, which rounds as torch does for every value but NaN and
	// subnormals; a block holding one of those is narrowed as on ISAAVX512.
	ISAAVX512BF16
	// ISAAVX512VBMI is ISAAVX512BF16 with AVX-512 VBMI (amd64): the bfloat16
	// single-tensor step looks the rounded square root of exp_avg_sq, divided
	// by bias_correction2_sqrt and rounded, up in a table of the step's 256
	// values (VPERMT2B) instead of computing it (bf16table.go).
	ISAAVX512VBMI
)

var isaNames = [...]string{ISAGo: "go", ISAAVX2: "avx2", ISAAVX512: "avx512", ISAAVX512BF16: "avx512bf16",
	ISAAVX512VBMI: "avx512vbmi"}

func (i ISA) String() string {
	if i < 0 || int(i) >= len(isaNames) {
		return fmt.Sprintf("ISA(%d)", int(i))
	}
	return isaNames[i]
}

// ParseISA returns the ISA named "go", "avx2", "avx512", "avx512bf16" or
// "avx512vbmi".
func ParseISA(name string) (ISA, error) {
	for i, n := range isaNames {
		if n == name {
			return ISA(i), nil
		}
	}
	return 0, fmt.Errorf("optimizer: unknown instruction set %q (want go, avx2, avx512, avx512bf16 or avx512vbmi)", name)
}

// cpuISA is the widest level this CPU (and its operating system) supports,
// detected once; vecISA is the level the kernels use: cpuISA unless lowered
// by LimitISA (or by a test).
var (
	cpuISA = detectISA()
	vecISA = cpuISA
)

// CPUISA returns the widest instruction set this CPU supports.
func CPUISA() ISA { return cpuISA }

// KernelISA returns the instruction set the kernels use.
func KernelISA() ISA { return vecISA }

// LimitISA caps the kernels' instruction set at max (it never raises it above
// the CPU's) and returns the level now in use. It is meant for start-up (a
// benchmark's baseline, or a user who wants the narrower path): call it
// before any step runs, not while one does.
func LimitISA(max ISA) ISA {
	vecISA = min(max, cpuISA)
	return vecISA
}
