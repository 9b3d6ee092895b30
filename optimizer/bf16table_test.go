package optimizer

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestBF16TableAllValues compares the table's lookup (what
// stepBF16AVX512VBMI computes) with StepBF16's two stages for every
// positive normal bfloat16 exp_avg_sq and bias corrections of the steps
// of several beta2, the range's ends and random values in it.
func TestBF16TableAllValues(t *testing.T) {
	var bc2s []float32
	for _, beta2 := range []float64{0.999, 0.99, 0.95, 0.5, 0.0, 0.9999999} {
		for _, step := range []int64{1, 2, 3, 10, 100, 1000, 100000} {
			bc2s = append(bc2s, ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: beta2, Eps: 1e-8}, step).f32().bc2s)
		}
	}
	r := rand.New(rand.NewPCG(5, 6))
	for range 40 {
		bc2s = append(bc2s, float32(math.Ldexp(1+r.Float64(), -1-r.IntN(32))))
	}
	bc2s = append(bc2s, 1, 0.5, 0x1p-32, math.Nextafter32(1, 0), math.Nextafter32(0x1p-32, 1), 0x1.fffffep-2)
	for _, b := range bc2s {
		var tb bf16Table
		if !tb.make(b) {
			t.Fatalf("bc2s %g (%#08x): no table", b, math.Float32bits(b))
		}
		for v := uint16(0x0080); v < 0x7F80; v++ {
			if got, want := tb.lookup(v), sqrtDivBF16(v, b); got != want {
				t.Fatalf("bc2s %g (%#08x), v %#04x: lookup %#04x, StepBF16's stages %#04x", b, math.Float32bits(b), v, got, want)
			}
		}
	}
}

// TestBF16TableRange: bc2s outside [2^-32, 1] has no table (the kernel
// then computes the stages), and fill reuses the last table made.
func TestBF16TableRange(t *testing.T) {
	var tb bf16Table
	for _, b := range []float32{0, -1, 1.0000001, 2, 0x1p-33, float32(math.NaN()), float32(math.Inf(1))} {
		if tb.make(b) || tb.fill(b) {
			t.Errorf("bc2s %g: table made", b)
		}
	}
	if !tb.fill(0.25) {
		t.Fatal("bc2s 0.25: no table")
	}
	first := lastBF16Table.Load()
	var again bf16Table
	if !again.fill(0.25) || lastBF16Table.Load() != first || again != tb {
		t.Error("fill made the same table again")
	}
}
