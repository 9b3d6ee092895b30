package vml

import (
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/sonar-moe/sonar/optimizer"
)

// TestEmulationEqualsMKL holds the claim behind sonard's --mkl-sqrt=auto:
// where optimizer.CheckMKLSqrt accepts the engine's emulation of this
// library's vmsSqrt, the two are equal for all 2^32 inputs
// (optimizer.VerifyMKLSqrt), and a step with either gives the same bytes.
// On a CPU where MKL runs another kernel (Intel's AVX2 or AVX-512 paths) the
// check refuses the emulation and there is nothing more to hold.
func TestEmulationEqualsMKL(t *testing.T) {
	if os.Getenv("MKL_NUM_THREADS") == "" {
		t.Setenv("MKL_NUM_THREADS", "1")
	}
	lib, err := Load(torchLib(t))
	if err != nil {
		t.Fatal(err)
	}
	emu, ok := optimizer.MKLSqrt()
	if !ok {
		t.Skip("no AVX2: no emulation on this CPU")
	}
	start := time.Now()
	if err := optimizer.CheckMKLSqrt(lib.Apply, 2); err != nil {
		t.Skipf("MKL runs another kernel on this CPU, the check refuses the emulation: %v", err)
	}
	t.Logf("check: %v", time.Since(start))
	if testing.Short() {
		t.Skip("-short: not comparing all 2^32 inputs")
	}
	start = time.Now()
	if err := optimizer.VerifyMKLSqrt(lib.Apply, 2); err != nil {
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
	if same == n {
		t.Error("MKL's square root gave the IEEE one's parameters: the comparison cannot tell them apart")
	}
}
