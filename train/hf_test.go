package train

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/sonar-moe/sonar/train/hfmoe"
	"github.com/sonar-moe/sonar/train/kernels"
)

func tinyHF(t *testing.T, aux bool) *hfmoe.Model[float32] {
	t.Helper()
	cfg := hfmoe.Config{Vocab: 32, Hidden: 16, Intermediate: 8, Layers: 3, Heads: 4, KVHeads: 2, Experts: 4, TopK: 2,
		NormEps: 1e-5, RopeTheta: 10000, AuxLoss: aux, RouterAuxCoef: 0.01, PadTokenID: -1}
	m, err := hfmoe.New[float32](cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(7, 0.1)
	return m
}

// patternBatch is a learnable batch: each row counts up from a random start.
func patternBatch(rng *rand.Rand, batch, seq, vocab int) (in, tg []int32) {
	in, tg = make([]int32, batch*seq), make([]int32, batch*seq)
	for b := range batch {
		s := rng.IntN(vocab)
		for i := range seq {
			in[b*seq+i] = int32((s + i) % vocab)
			tg[b*seq+i] = int32((s + i + 1) % vocab)
		}
	}
	return in, tg
}

func hfBytes(m *hfmoe.Model[float32]) []byte {
	var b bytes.Buffer
	for _, p := range m.Params() {
		b.Write(kernels.Bytes(p.W))
	}
	return b.Bytes()
}

func TestHFPerLayerMatchesKeepAll(t *testing.T) {
	for _, aux := range []bool{false, true} {
		var bits [2][]byte
		var mem [2]Memory
		for i, keep := range []bool{false, true} {
			m := tinyHF(t, aux)
			o := Options{Hyper: DefaultHyper(), MaxGradNorm: 0.5, KeepAllGrads: keep}
			tr, err := NewHF(m, 3, 8, o)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			for range 4 {
				in, tg := patternBatch(rng, 3, 8, 32)
				if _, err := tr.Step(in, tg, 3e-3); err != nil {
					t.Fatal(err)
				}
			}
			bits[i], mem[i] = hfBytes(m), tr.Memory()
		}
		if !bytes.Equal(bits[0], bits[1]) {
			t.Errorf("aux=%v: per-layer and keep-all parameters differ", aux)
		}
		if mem[0].Peak != mem[0].LayerBytes || mem[1].Peak != mem[1].AllBytes || mem[0].LayerBytes*3 != mem[0].AllBytes {
			t.Errorf("aux=%v: peaks %d (per layer) and %d (keep all), layer %d", aux, mem[0].Peak, mem[1].Peak, mem[0].LayerBytes)
		}
	}
}

func TestHFLossFalls(t *testing.T) {
	m := tinyHF(t, true)
	tr, err := NewHF(m, 4, 12, Options{Hyper: DefaultHyper(), MaxGradNorm: 1})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	evalIn, evalTg := patternBatch(rng, 4, 12, 32)
	before, err := tr.Eval(evalIn, evalTg)
	if err != nil {
		t.Fatal(err)
	}
	for range 40 {
		in, tg := patternBatch(rng, 4, 12, 32)
		if _, err := tr.Step(in, tg, 1e-2); err != nil {
			t.Fatal(err)
		}
	}
	after, err := tr.Eval(evalIn, evalTg)
	if err != nil {
		t.Fatal(err)
	}
	if !(after.CE < 0.5*before.CE) {
		t.Errorf("held-out cross-entropy %.4f -> %.4f: want it at least halved", before.CE, after.CE)
	}
}
