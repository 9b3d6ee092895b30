package optimizer

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"unsafe"
)

// TestAssemblyMatchesScalarPath runs every kernel with the assembly passes
// on and off and requires identical bytes: the two paths must perform the
// same IEEE operations lane for lane.
func TestAssemblyMatchesScalarPath(t *testing.T) {
	if !useAVX2 {
		t.Skip("no AVX2+FMA on this CPU: only the scalar path exists")
	}
	cases := []struct {
		name string
		h    Hyper
	}{
		{"default", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}},
		{"no-decay", Hyper{LR: 3e-2, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6}},
		{"maximize", Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1, Maximize: true}},
		{"lerp-weight-over-half", Hyper{LR: 5e-2, Beta1: 0.3, Beta2: 0.95, Eps: 1e-3, WeightDecay: 0.5}},
	}
	r := rand.New(rand.NewPCG(7, 8))
	for _, c := range cases {
		for _, n := range []int{8, 9, 511, 512, 513, 1031, 4096 + 77} {
			mk := func() []float32 {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(r.NormFloat64() * float64(int(1)<<r.IntN(8)) / 64)
				}
				return x
			}
			p, g, m, v := mk(), mk(), mk(), mk()
			for i := range v {
				v[i] *= v[i]
			}
			for _, bf := range []bool{false, true} {
				run := func(asm bool) [][]byte {
					old := useAVX2
					useAVX2 = asm
					defer func() { useAVX2 = old }()
					if bf {
						cv := func(x []float32) []uint16 {
							o := make([]uint16, n)
							for i := range o {
								o[i] = F32ToBF16(x[i])
							}
							return o
						}
						pp, gg, mm, vv := cv(p), cv(g), cv(m), cv(v)
						for step := int64(1); step <= 3; step++ {
							StepBF16(pp, gg, mm, vv, nil, ScalarsFor(c.h, step))
						}
						return [][]byte{u16b(pp), u16b(mm), u16b(vv)}
					}
					pp, mm, vv := append([]float32(nil), p...), append([]float32(nil), m...), append([]float32(nil), v...)
					for step := int64(1); step <= 3; step++ {
						StepF32(pp, g, mm, vv, nil, ScalarsFor(c.h, step), nil)
					}
					return [][]byte{f32b(pp), f32b(mm), f32b(vv)}
				}
				a, s := run(true), run(false)
				for i := range a {
					if !bytes.Equal(a[i], s[i]) {
						t.Fatalf("%s n=%d bf16=%v: buffer %d differs between assembly and scalar paths", c.name, n, bf, i)
					}
				}
			}
		}
	}
}

func f32b(x []float32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x)) }
func u16b(x []uint16) []byte  { return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 2*len(x)) }
