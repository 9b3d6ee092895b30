package optimizer

import (
	"bytes"
	"math"
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

// TestFusedAssemblyMatchesScalarPath is TestAssemblyMatchesScalarPath for the
// fused kernels: every hyper-parameter branch, sizes with and without a
// tail, chunks that start inside the tensor (as the engine's workers get
// them), float32 and bfloat16 with 8 and 16 lanes, special values included.
func TestFusedAssemblyMatchesScalarPath(t *testing.T) {
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
		{"amsgrad", Hyper{LR: 1e-3, Beta1: 0.8, Beta2: 0.99, Eps: 1e-8, WeightDecay: 0.01, Amsgrad: true}},
	}
	specials := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 0, float32(math.Copysign(0, -1)),
		math.SmallestNonzeroFloat32, 1e-39, -3e-40, math.MaxFloat32}
	r := rand.New(rand.NewPCG(9, 10))
	for _, c := range cases {
		for _, n := range []int{8, 15, 16, 17, 511, 1031, 4096 + 77} {
			mk := func(square bool) []float32 {
				x := make([]float32, n)
				for i := range x {
					x[i] = float32(r.NormFloat64() * float64(int(1)<<r.IntN(8)) / 64)
					if square {
						x[i] *= x[i]
					}
				}
				if n > 40 {
					for j, s := range specials {
						if square && s < 0 {
							s = -s
						}
						x[(j*37+r.IntN(5))%n] = s
					}
				}
				return x
			}
			p, g, m, v, vm := mk(false), mk(false), mk(false), mk(true), mk(true)
			for _, lanes := range []int{8, 16} {
				for _, bf := range []bool{false, true} {
					run := func(asm bool) [][]byte {
						old := useAVX2
						useAVX2 = asm
						defer func() { useAVX2 = old }()
						var out [][]byte
						// Two chunks, as two engine workers would update them.
						cut := (n / 2) &^ 3
						for step := int64(1); step <= 3; step++ {
							s := ScalarsFor(c.h, step)
							s.Fused, s.Lanes = true, lanes
							if bf {
								if out == nil {
									out = [][]byte{u16b(toBF(p)), u16b(toBF(g)), u16b(toBF(m)), u16b(toBF(v)), u16b(toBF(vm))}
								}
								pp, gg, mm, vv, xx := b2u16(out[0]), b2u16(out[1]), b2u16(out[2]), b2u16(out[3]), b2u16(out[4])
								FusedStepBF16(pp[:cut], gg[:cut], mm[:cut], vv[:cut], xx[:cut], s, 0, n)
								FusedStepBF16(pp[cut:], gg[cut:], mm[cut:], vv[cut:], xx[cut:], s, cut, n)
							} else {
								if out == nil {
									out = [][]byte{f32b(clone32(p)), f32b(g), f32b(clone32(m)), f32b(clone32(v)), f32b(clone32(vm))}
								}
								pp, gg, mm, vv, xx := b2f32(out[0]), b2f32(out[1]), b2f32(out[2]), b2f32(out[3]), b2f32(out[4])
								FusedStepF32(pp[:cut], gg[:cut], mm[:cut], vv[:cut], xx[:cut], s, 0, n)
								FusedStepF32(pp[cut:], gg[cut:], mm[cut:], vv[cut:], xx[cut:], s, cut, n)
							}
						}
						return out
					}
					a, s := run(true), run(false)
					for i := range a {
						if !bytes.Equal(a[i], s[i]) {
							t.Fatalf("%s n=%d lanes=%d bf16=%v: buffer %d differs between assembly and scalar paths", c.name, n, lanes, bf, i)
						}
					}
				}
			}
		}
	}
}

func toBF(x []float32) []uint16 {
	o := make([]uint16, len(x))
	for i := range o {
		o[i] = F32ToBF16(x[i])
	}
	return o
}

func clone32(x []float32) []float32 { return append([]float32(nil), x...) }
func b2f32(b []byte) []float32      { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }
func b2u16(b []byte) []uint16       { return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2) }
