package train

import (
	"math/rand/v2"
	"testing"

	"github.com/sonar-moe/sonar/train/hfmoe"
)

// BenchmarkHFStep is one training step of the configuration that
// bench/olmoe_go_vs_torch.py compares with torch (4 layers x 8 experts,
// hidden 128, intermediate 128, vocab 256, 8 x 128 tokens).
func BenchmarkHFStep(b *testing.B) {
	cfg := hfmoe.Config{Vocab: 256, Hidden: 128, Intermediate: 128, Layers: 4, Heads: 4, KVHeads: 4, Experts: 8, TopK: 2,
		NormEps: 1e-5, RopeTheta: 10000, RouterAuxCoef: 0.01, PadTokenID: -1}
	m, err := hfmoe.New[float32](cfg)
	if err != nil {
		b.Fatal(err)
	}
	m.Init(1, 0.02)
	tr, err := NewHF(m, 8, 128, Options{Hyper: DefaultHyper(), MaxGradNorm: 1})
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	in, tg := make([]int32, 8*128), make([]int32, 8*128)
	for i := range in {
		in[i], tg[i] = int32(rng.IntN(256)), int32(rng.IntN(256))
	}
	b.ResetTimer()
	for range b.N {
		if _, err := tr.Step(in, tg, 1e-3); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(in))/b.Elapsed().Seconds(), "tokens/s")
}
