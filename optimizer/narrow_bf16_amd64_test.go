package optimizer

import (
	"math"
	"testing"
)

// TestBF16NarrowingAllFloat32 holds the AVX-512 BF16 narrowing of the fused
// bfloat16 kernel (VCVTNE2PS2BF16 where no lane of 32 is a NaN or
// subnormal, the integer rounding where one is) to torch's vector
// conversion (f32ToBF16Vec) for every float32 bit pattern (-short: every
// 16th block of 2^20 and the blocks where the kinds of value change), 32
// consecutive patterns a block. Then the blocks around each change of kind
// again, 16 patterns later, so that one block of 32 mixes a NaN or
// subnormal with ordinary values (as a kernel's block may).
func TestBF16NarrowingAllFloat32(t *testing.T) {
	if cpuISA < ISAAVX512BF16 {
		t.Skipf("this CPU runs %v: no AVX-512 BF16", cpuISA)
	}
	c := newFusedConsts(fusedScalars{bc2s: 1})
	const block = 1 << 20
	src := make([]float32, block)
	dst := make([]uint16, block)
	// The blocks of 2^20 patterns where subnormals, infinities and NaNs begin
	// or end, for each sign.
	edge := func(base uint64) bool {
		switch uint32(base) {
		case 0, 0x00700000, 0x7F800000, 0x7F700000, 0x7FF00000, 0x80000000, 0x80700000, 0xFF700000, 0xFF800000, 0xFFF00000:
			return true
		}
		return false
	}
	checked := 0
	for _, shift := range []uint64{0, 16} {
		for base := uint64(0); base < 1<<32; base += block {
			if !edge(base) && (shift != 0 || testing.Short() && (base/block)%16 != 5) {
				continue
			}
			for i := range src {
				src[i] = math.Float32frombits(uint32(base + shift + uint64(i)))
			}
			narrowBF16AVX512BF16(&dst[0], &src[0], block, &c)
			for j := 0; j < block; j += 32 {
				for i := 0; i < 32; i++ {
					x := src[j+i]
					got := dst[j+2*(i%16)+i/16]
					if want := bf16VecRef(math.Float32bits(x)); got != want {
						t.Fatalf("float32 %#08x: narrowed to %#04x, torch's vector conversion gives %#04x",
							math.Float32bits(x), got, want)
					}
				}
			}
			checked += block
		}
	}
	t.Logf("%d float32 patterns checked", checked)
}

// bf16VecRef is f32ToBF16Vec on the bits, for speed: round to nearest even,
// NaN 0xFFFF.
func bf16VecRef(b uint32) uint16 {
	if b&0x7FFFFFFF > 0x7F800000 {
		return 0xFFFF
	}
	return uint16((b + 0x7FFF + (b>>16)&1) >> 16)
}

// TestBF16VecRef holds bf16VecRef to f32ToBF16Vec on a spread of patterns.
func TestBF16VecRef(t *testing.T) {
	for b := uint64(0); b < 1<<32; b += 65521 {
		x := math.Float32frombits(uint32(b))
		if bf16VecRef(uint32(b)) != f32ToBF16Vec(x) {
			t.Fatalf("%#08x: %#04x vs %#04x", b, bf16VecRef(uint32(b)), f32ToBF16Vec(x))
		}
	}
}
