package train

import (
	"math/rand/v2"
	"testing"

	"github.com/sonar-moe/sonar/train/model"
)

// BenchmarkStep times one training step of the default model (16 x 64 bytes).
func BenchmarkStep(b *testing.B) {
	for _, keep := range []bool{false, true} {
		name := "per-layer"
		if keep {
			name = "keep-all"
		}
		b.Run(name, func(b *testing.B) {
			m, err := model.New(model.DefaultConfig(), 1)
			if err != nil {
				b.Fatal(err)
			}
			tr, err := New(m, 16, 64, Options{Hyper: DefaultHyper(), MaxGradNorm: 1, KeepAllGrads: keep})
			if err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 1))
			in, tgt := make([]int32, 16*64), make([]int32, 16*64)
			for i := range in {
				in[i], tgt[i] = int32(rng.IntN(256)), int32(rng.IntN(256))
			}
			for b.Loop() {
				if _, err := tr.Step(in, tgt, 1e-3); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*len(in))/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}
