package vml

import (
	"debug/elf"
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/sonar-moe/sonar/optimizer"
)

// TestEmulationEqualsMKL holds the claim behind sonard's --mkl-sqrt=auto:
// where optimizer.CheckMKLSqrt accepts the engine's emulation of this
// library's vmsSqrt, the two are equal for all 2^32 inputs
// (optimizer.VerifyMKLSqrt), and a step with either gives the same bytes.
// On a CPU where MKL runs a kernel not emulated (its AVX-512 path) the check
// refuses the emulations and there is nothing more to hold.
func TestEmulationEqualsMKL(t *testing.T) {
	if os.Getenv("MKL_NUM_THREADS") == "" {
		t.Setenv("MKL_NUM_THREADS", "1")
	}
	lib, err := Load(torchLib(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(optimizer.MKLSqrts()) == 0 {
		t.Skip("no AVX2 and FMA: no emulation on this CPU")
	}
	start := time.Now()
	emu, err := optimizer.FindMKLSqrt(lib.Apply, 2)
	if err != nil {
		t.Skipf("MKL runs another kernel on this CPU, the check refuses every emulation: %v", err)
	}
	t.Logf("check: %v picked in %v", emu, time.Since(start))
	if testing.Short() {
		t.Skip("-short: not comparing all 2^32 inputs")
	}
	start = time.Now()
	if err := optimizer.VerifyMKLSqrt(emu, lib.Apply, 2); err != nil {
		t.Fatalf("the check accepted an emulation that differs: %v", err)
	}
	t.Logf("all 2^32 inputs: %v", time.Since(start))

	r := rand.New(rand.NewPCG(31, 32))
	const n = 3*4096 + 13
	p, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range p {
		p[i], g[i], m[i] = float32(r.NormFloat64()), float32(r.NormFloat64()*1e-2), float32(r.NormFloat64()*1e-2)
		v[i] = float32(math.Abs(r.NormFloat64()) * 1e-4)
	}
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	run := func(q optimizer.Sqrt) []float32 {
		pp, mm, vv := append([]float32(nil), p...), append([]float32(nil), m...), append([]float32(nil), v...)
		for step := int64(1); step <= 3; step++ {
			optimizer.StepF32(pp, g, mm, vv, nil, optimizer.ScalarsFor(h, step), q)
		}
		return pp
	}
	a, b, c := run(optimizer.CallSqrt(lib.Apply)), run(emu), run(optimizer.Sqrt{})
	same := 0
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			t.Fatalf("element %d: %g calling MKL, %g emulating it", i, a[i], b[i])
		}
		if a[i] == c[i] {
			same++
		}
	}
	// MKL's SSE kernel is not correctly rounded on a good share of inputs, so
	// its parameters must differ from the IEEE ones somewhere (its FMA
	// kernel may be correctly rounded with some CPUs' approximation).
	if same == n && emu.String() == "mkl-sse" {
		t.Error("MKL's square root gave the IEEE one's parameters: the comparison cannot tell them apart")
	}
}

// TestFMAEmulationEqualsL9Kernel compares the FMA emulation with the MKL
// kernel it reproduces, mkl_vml_kernel_sSqrt_L9HAynn (what vmsSqrt runs on
// Intel CPUs with AVX2), called directly at its address in the library (the
// symbol table's offset from vmsSqrt), for every non-negative input: on a CPU where
// vmsSqrt itself runs another kernel (AMD's), this is the only way to check
// that emulation against MKL. The instructions are AVX2 and FMA, which any
// CPU the emulation runs on has; only the reciprocal square root's
// approximation differs between vendors, and the emulation uses the same
// instruction.
func TestFMAEmulationEqualsL9Kernel(t *testing.T) {
	lib, err := Load(torchLib(t))
	if err != nil {
		t.Fatal(err)
	}
	var fma optimizer.Sqrt
	for _, q := range optimizer.MKLSqrts() {
		if q.String() == "mkl-fma" {
			fma = q
		}
	}
	if !fma.IsMKLEmulation() {
		t.Skip("no AVX2 and FMA: no emulation on this CPU")
	}
	f, err := elf.Open(lib.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.Symbols()
	if err != nil {
		t.Skipf("%s has no symbol table: %v", lib.Path, err)
	}
	addr := map[string]uint64{}
	for _, s := range syms {
		if s.Name == "vmsSqrt" || s.Name == "mkl_vml_kernel_sSqrt_L9HAynn" {
			addr[s.Name] = s.Value
		}
	}
	if addr["vmsSqrt"] == 0 || addr["mkl_vml_kernel_sSqrt_L9HAynn"] == 0 {
		t.Skipf("%s does not name MKL's L9 kernel in its symbol table", lib.Path)
	}
	l9 := lib.fn - uintptr(addr["vmsSqrt"]) + uintptr(addr["mkl_vml_kernel_sSqrt_L9HAynn"])
	call := func(dst, src []float32) { // kernel(int n, const float *a, float *r)
		if len(src) > 0 {
			_ = dst[len(src)-1]
			purego.SyscallN(l9, uintptr(len(src)), uintptr(unsafe.Pointer(&src[0])), uintptr(unsafe.Pointer(&dst[0])))
		}
	}
	if err := optimizer.CheckMKLSqrt(fma, call, 2); err != nil {
		t.Fatalf("check: %v", err)
	}
	if testing.Short() {
		t.Skip("-short: not comparing all 2^32 inputs")
	}
	// Every non-negative pattern (+0 to the NaNs); of the negative half, which
	// the kernel hands lane by lane to its scalar code (minutes for all 2^31),
	// every 251st pattern.
	start := time.Now()
	if err := optimizer.VerifyMKLSqrtRange(fma, call, 2, 0, 1<<31, 1); err != nil {
		t.Fatal(err)
	}
	if err := optimizer.VerifyMKLSqrtRange(fma, call, 2, 1<<31, 1<<32, 251); err != nil {
		t.Fatal(err)
	}
	t.Logf("2^31 + 2^31/251 inputs: %v", time.Since(start))
}
