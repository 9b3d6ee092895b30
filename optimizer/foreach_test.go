package optimizer

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"
)

// TestRefCloseToCPU keeps the reference honest in a coarser way: over many
// steps it must stay within a few ulp of the CPU engine (which rounds a few
// operations differently: addcmul's product and bfloat16 eps).
func TestRefCloseToCPU(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const n = 4096
	h := Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1}
	p0, m0, v0 := make([]float32, n), make([]float32, n), make([]float32, n)
	p1, m1, v1 := make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range p0 {
		p0[i] = float32(r.NormFloat64())
		p1[i] = p0[i]
	}
	g := make([]float32, n)
	same := 0
	for step := int64(1); step <= 20; step++ {
		for i := range g {
			g[i] = float32(r.NormFloat64() * 0.1)
		}
		sc := ScalarsFor(h, step)
		ForeachStepF32(p0, g, m0, v0, nil, sc)
		StepF32(p1, g, m1, v1, nil, sc, Sqrt{})
	}
	for i := range p0 {
		if p0[i] == p1[i] {
			same++
		}
		if d := math.Abs(float64(p0[i] - p1[i])); d > 1e-5*math.Abs(float64(p1[i]))+1e-7 {
			t.Fatalf("element %d: reference %v, CPU engine %v", i, p0[i], p1[i])
		}
	}
	t.Logf("%d of %d parameters bitwise equal to the CPU path after 20 steps", same, n)
}

func TestRefStepBytes(t *testing.T) {
	sc := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}, 1)
	for _, dt := range []DType{Float32, BFloat16} {
		n := 64
		sz := dt.Size()
		p, g, m, v := make([]byte, n*sz), make([]byte, n*sz), make([]byte, n*sz), make([]byte, n*sz)
		for i := 0; i < n; i++ {
			switch dt {
			case Float32:
				binary.LittleEndian.PutUint32(p[4*i:], math.Float32bits(1))
				binary.LittleEndian.PutUint32(g[4*i:], math.Float32bits(0.5))
			default:
				binary.LittleEndian.PutUint16(p[2*i:], ForeachBF16(1))
				binary.LittleEndian.PutUint16(g[2*i:], ForeachBF16(0.5))
			}
		}
		if err := ForeachStep(dt, p, g, m, v, nil, sc); err != nil {
			t.Fatal(err)
		}
		// Step 1 of AdamW moves every parameter by about -lr (sign of g) after decay.
		var got float32
		if dt == Float32 {
			got = math.Float32frombits(binary.LittleEndian.Uint32(p))
		} else {
			got = BF16ToF32(binary.LittleEndian.Uint16(p))
		}
		if math.Abs(float64(got)-(1*(1-1e-5)-1e-3)) > 1e-2 {
			t.Errorf("%v: p after one step = %v", dt, got)
		}
		if err := ForeachAdd(dt, g, g); err != nil {
			t.Fatal(err)
		}
	}
	if err := ForeachStep(DType(9), nil, nil, nil, nil, nil, sc); err == nil {
		t.Error("unknown dtype accepted")
	}
}
