package optimizer

import (
	"fmt"
	"math"
	"sync"
	"testing"
)

// TestWideMKLSqrtAllFloat32 holds the 16-lane emulations of MKL's SSE and
// FMA square root kernels (mklSqrtSSEAVX512, whose macros the AVX-512 step
// kernel uses) to the 8-lane ones (mklSqrtAVX2), which the exhaustive
// comparison with MKL itself covers (VerifyMKLSqrt), for every float32 bit
// pattern (-short: every 16th block of 2^20 and the blocks where the kinds
// of value change), bit for bit, NaNs included. The blocks are consecutive
// patterns, so every block of 16 mixes whatever kinds meet there. (Not in
// make test-avx512's emulated run, whose TestMKLSqrtOnePassMatchesBlocks
// covers the 16-lane step: an emulated CPU would take hours here.)
func TestWideMKLSqrtAllFloat32(t *testing.T) {
	if cpuISA < ISAAVX512 {
		t.Skipf("this CPU runs %v: no AVX-512", cpuISA)
	}
	const block = 1 << 20
	edge := func(base uint64) bool {
		switch uint32(base) {
		case 0, 0x00700000, 0x7F000000, 0x7F700000, 0x7F800000, 0x7FF00000, 0x80000000, 0x80700000, 0xFF700000, 0xFF800000, 0xFFF00000:
			return true
		}
		return false
	}
	for _, fma := range []bool{false, true} {
		t.Run(fmt.Sprintf("fma=%v", fma), func(t *testing.T) {
			var (
				mu      sync.Mutex
				wg      sync.WaitGroup
				checked int
				failure error
			)
			bases := make(chan uint64)
			for range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					src := make([]float32, block)
					narrow, wide := make([]float32, block), make([]float32, block)
					for base := range bases {
						for i := range src {
							src[i] = math.Float32frombits(uint32(base + uint64(i)))
						}
						mklSqrtAVX2(&narrow[0], &src[0], block, fma)
						mklSqrtSSEAVX512(&wide[0], &src[0], block, fma)
						for i := range src {
							if a, b := math.Float32bits(narrow[i]), math.Float32bits(wide[i]); a != b {
								mu.Lock()
								if failure == nil {
									failure = fmt.Errorf("sqrt(%#08x): 16 lanes give %#08x, 8 lanes %#08x", math.Float32bits(src[i]), b, a)
								}
								mu.Unlock()
								break
							}
						}
						mu.Lock()
						checked += block
						mu.Unlock()
					}
				}()
			}
			for base := uint64(0); base < 1<<32; base += block {
				if testing.Short() && !edge(base) && (base/block)%16 != 5 {
					continue
				}
				bases <- base
			}
			close(bases)
			wg.Wait()
			if failure != nil {
				t.Fatal(failure)
			}
			t.Logf("%d float32 patterns checked", checked)
		})
	}
}
