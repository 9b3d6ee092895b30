package train

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"unsafe"

	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/train/kernels"
	"github.com/sonar-moe/sonar/train/model"
)

func smallConfig(layers, experts, topK int) model.Config {
	return model.Config{Vocab: 256, Hidden: 16, Intermediate: 24, Layers: layers, Experts: experts, TopK: topK, MixWindow: 4, NormEps: 1e-6}
}

// text is a small repetitive corpus.
var text = []byte(strings.Repeat("func main() {\n\tfmt.Println(\"hello, world\")\n}\n// the quick brown fox jumps over the lazy dog\n", 40))

func batch(rng *rand.Rand, b, seq int) (in, tgt []int32) {
	in, tgt = make([]int32, b*seq), make([]int32, b*seq)
	for i := range b {
		o := rng.IntN(len(text) - seq - 1)
		for j := range seq {
			in[i*seq+j], tgt[i*seq+j] = int32(text[o+j]), int32(text[o+j+1])
		}
	}
	return in, tgt
}

// snapshot is every parameter and optimizer state byte of a trainer.
func snapshot(m *model.Model, tr *Trainer) []byte {
	var b bytes.Buffer
	for _, p := range m.Params() {
		b.Write(kernels.Bytes(p.W))
	}
	for _, l := range tr.layers {
		for _, x := range []*optimizer.Tensor{l.gateUp, l.down} {
			b.Write(x.ExpAvg)
			b.Write(x.ExpAvgSq)
			fmt.Fprint(&b, x.Step)
		}
	}
	for _, d := range tr.denseT {
		b.Write(d.t.ExpAvg)
		b.Write(d.t.ExpAvgSq)
		fmt.Fprint(&b, d.t.Step)
	}
	return b.Bytes()
}

func newTrainer(t *testing.T, cfg model.Config, seed uint64, o Options, b, seq int) (*model.Model, *Trainer) {
	t.Helper()
	m, err := model.New(cfg, seed)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := New(m, b, seq, o)
	if err != nil {
		t.Fatal(err)
	}
	return m, tr
}

// Per-layer updates in backward and standard training (every expert
// gradient kept, all applied after backward) must give the same bits, and
// hold one layer versus all layers of expert gradients.
func TestPerLayerMatchesKeepAll(t *testing.T) {
	cases := []struct {
		name                  string
		layers, experts, topK int
		clip                  float64
		steps                 int
	}{
		{"1 layer, no clipping", 1, 4, 2, 0, 3},
		{"3 layers, clipped", 3, 4, 2, 0.05, 4},
		{"2 layers, top-1, loose clip", 2, 3, 1, 10, 3},
		{"4 layers, top-3 of 6", 4, 6, 3, 1, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := smallConfig(c.layers, c.experts, c.topK)
			var snaps [2][]byte
			var mems [2]Memory
			var scales [2][]float64
			for i, keep := range []bool{false, true} {
				o := Options{Hyper: DefaultHyper(), MaxGradNorm: c.clip, KeepAllGrads: keep}
				m, tr := newTrainer(t, cfg, 11, o, 3, 16)
				rng := rand.New(rand.NewPCG(5, 6))
				for s := 1; s <= c.steps; s++ {
					in, tgt := batch(rng, 3, 16)
					st, err := tr.Step(in, tgt, 1e-2/float64(s))
					if err != nil {
						t.Fatal(err)
					}
					scales[i] = append(scales[i], st.ClipScale)
				}
				snaps[i], mems[i] = snapshot(m, tr), tr.Memory()
			}
			if !bytes.Equal(snaps[0], snaps[1]) {
				t.Error("parameters or optimizer state differ between per-layer updates and keep-all")
			}
			if c.clip == 0.05 && scales[0][0] == 1 {
				t.Error("a max norm of 0.05 did not clip")
			}
			layer := mems[0].LayerBytes
			if mems[0].Peak != layer || mems[0].Live != 0 {
				t.Errorf("per-layer: peak %d live %d, want peak %d (one layer) and nothing live", mems[0].Peak, mems[0].Live, layer)
			}
			if mems[1].Peak != int64(c.layers)*layer || mems[1].AllBytes != mems[1].Peak {
				t.Errorf("keep-all: peak %d, want %d (%d layers)", mems[1].Peak, int64(c.layers)*layer, c.layers)
			}
		})
	}
}

// Each layer's experts are updated before backward reaches the layer
// below, last layer first, and dense tensors only after backward.
func TestExpertsUpdatedDuringBackward(t *testing.T) {
	const layers = 3
	m, tr := newTrainer(t, smallConfig(layers, 4, 2), 3, Options{Hyper: DefaultHyper(), MaxGradNorm: 1}, 2, 8)
	var seen []int
	tr.onBuffers = func(l int) {
		seen = append(seen, l)
		for j, lt := range tr.layers {
			want := int64(0)
			if j > l {
				want = 1
			}
			if lt.gateUp.Step != want || lt.down.Step != want {
				t.Errorf("asking for layer %d's buffers: layer %d experts at step %d/%d, want %d", l, j, lt.gateUp.Step, lt.down.Step, want)
			}
		}
		for _, d := range tr.denseT {
			if d.t.Step != 0 {
				t.Errorf("dense %s stepped during backward", d.p.Name)
			}
		}
		if tr.mem.Live != 0 {
			t.Errorf("layer %d: %d expert-gradient bytes alive from an earlier layer", l, tr.mem.Live)
		}
	}
	in, tgt := batch(rand.New(rand.NewPCG(1, 1)), 2, 8)
	before := append([]float32(nil), m.Blocks[layers-1].GateUp.W...)
	if _, err := tr.Step(in, tgt, 1e-3); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(seen) != "[2 1 0]" {
		t.Errorf("buffers asked for layers %v, want [2 1 0]", seen)
	}
	for _, d := range tr.denseT {
		if d.t.Step != 1 {
			t.Errorf("dense %s at step %d after one step", d.p.Name, d.t.Step)
		}
	}
	if bytes.Equal(kernels.Bytes(before), kernels.Bytes(m.Blocks[layers-1].GateUp.W)) {
		t.Error("expert weights did not change")
	}
}

// The engine's tensors update the model's own weight memory.
func TestExpertTensorsAliasWeights(t *testing.T) {
	m, tr := newTrainer(t, smallConfig(2, 4, 2), 1, Options{Hyper: DefaultHyper()}, 1, 4)
	for l, pair := range tr.ExpertTensors() {
		for i, w := range [][]float32{m.Blocks[l].GateUp.W, m.Blocks[l].Down.W} {
			p := pair[i].Param
			if unsafe.Pointer(&p[0]) != unsafe.Pointer(&w[0]) || len(p) != 4*len(w) {
				t.Errorf("layer %d tensor %s: Param is not the weight memory", l, pair[i].Name)
			}
		}
	}
	for _, d := range tr.denseT {
		if unsafe.Pointer(&d.t.Param[0]) != unsafe.Pointer(&d.p.W[0]) {
			t.Errorf("dense %s: Param is not the weight memory", d.p.Name)
		}
	}
	// Weights covers every parameter of the model once.
	seen := map[*float32]bool{}
	for _, w := range tr.Weights() {
		seen[&w[0]] = true
	}
	for _, p := range m.Params() {
		if !seen[&p.W[0]] {
			t.Errorf("Weights lacks %s", p.Name)
		}
	}
	if len(seen) != len(m.Params()) {
		t.Errorf("Weights has %d tensors, the model %d", len(seen), len(m.Params()))
	}
}

func TestClipGlobalNorm(t *testing.T) {
	cases := []struct {
		name      string
		grads     [][]float32
		max       float64
		wantNorm  float64
		wantScale float64
	}{
		{"off", [][]float32{{3}, {4}}, 0, 5, 1},
		{"below", [][]float32{{3}, {4}}, 10, 5, 1},
		{"equal: the 1e-6 still scales, as in torch", [][]float32{{3, 0}, {4}}, 5, 5, float64(float32(5 / (5 + 1e-6)))},
		{"above", [][]float32{{3}, {4}}, 1, 5, float64(float32(1 / (5 + 1e-6)))},
		{"zero", [][]float32{{0, 0}}, 1, 0, 1},
		{"many", [][]float32{{1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}}, 2, 4, float64(float32(2 / (4 + 1e-6)))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			orig := make([][]float32, len(c.grads))
			for i, g := range c.grads {
				orig[i] = append([]float32(nil), g...)
			}
			norm, scale := ClipGlobalNorm(c.grads, c.max)
			if math.Abs(norm-c.wantNorm) > 1e-12 || scale != c.wantScale {
				t.Fatalf("norm %v scale %v, want %v %v", norm, scale, c.wantNorm, c.wantScale)
			}
			for i, g := range c.grads {
				for j := range g {
					if want := orig[i][j] * float32(scale); g[j] != want {
						t.Fatalf("grad %d[%d] = %v, want %v", i, j, g[j], want)
					}
				}
			}
		})
	}
}

func TestSchedule(t *testing.T) {
	s := Schedule{Peak: 1, Warmup: 10, Total: 110, MinFrac: 0.1}
	cases := []struct {
		step int
		want float64
	}{{1, 0.1}, {5, 0.5}, {10, 1}, {60, 0.55}, {110, 0.1}, {500, 0.1}}
	for _, c := range cases {
		if got := s.LR(c.step); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("LR(%d) = %v, want %v", c.step, got, c.want)
		}
	}
	if got := (Schedule{Peak: 2}).LR(7); got != 2 {
		t.Errorf("constant schedule: %v", got)
	}
}

func TestNewRejects(t *testing.T) {
	m, err := model.New(smallConfig(1, 2, 1), 1)
	if err != nil {
		t.Fatal(err)
	}
	bad := DefaultHyper()
	bad.Beta1 = 1
	ams := DefaultHyper()
	ams.Amsgrad = true
	cases := []struct {
		name string
		o    Options
		b    int
	}{
		{"bad beta", Options{Hyper: bad}, 1},
		{"amsgrad", Options{Hyper: ams}, 1},
		{"negative clip", Options{Hyper: DefaultHyper(), MaxGradNorm: -1}, 1},
		{"empty batch", Options{Hyper: DefaultHyper()}, 0},
	}
	for _, c := range cases {
		if _, err := New(m, c.b, 4, c.o); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
}

// A few dozen steps on repetitive text bring the loss well down.
func TestLossFalls(t *testing.T) {
	_, tr := newTrainer(t, smallConfig(2, 4, 2), 2, Options{Hyper: DefaultHyper(), MaxGradNorm: 1}, 8, 32)
	rng := rand.New(rand.NewPCG(9, 9))
	sched := Schedule{Peak: 1e-2, Warmup: 5, Total: 60, MinFrac: 0.1}
	var first, last float64
	for s := 1; s <= 60; s++ {
		in, tgt := batch(rng, 8, 32)
		st, err := tr.Step(in, tgt, sched.LR(s))
		if err != nil {
			t.Fatal(err)
		}
		if s == 1 {
			first = st.Loss
		}
		last = st.Loss
	}
	if !(first > 5 && last < 2.5) {
		t.Errorf("loss %.3f -> %.3f, want from about ln 256 to below 2.5", first, last)
	}
}
