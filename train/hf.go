package train

import (
	"fmt"
	"math"
	"time"

	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/train/hfmoe"
	"github.com/sonar-moe/sonar/train/model"
)

// HFTrainer fine-tunes an OLMoE or GraniteMoe model (package train/hfmoe,
// float32) the way Trainer trains the byte-level model: each layer's batched
// expert tensors (gate_up_proj, down_proj) are stepped by the expert engine
// inside backward, the moment their gradients are final, through one layer-sized
// gradient buffer; every other parameter (embedding, attention, norms,
// router, head) is a dense tensor stepped after backward with global-norm
// clipping over the dense gradients only. With KeepAllGrads it is the
// standard baseline, which ends with the same bits.
type HFTrainer struct {
	m                *hfmoe.Model[float32]
	pass             *hfmoe.Pass[float32]
	opts             Options
	experts, dense   *optimizer.Engine
	layers           []layerTensors
	denseT           []hfDense
	mem              Memory
	lr               float64
	gradGU, gradDown [][]float32
	pending          []bool
}

type hfDense struct {
	t *optimizer.Tensor
	p *hfmoe.Param[float32]
}

// NewHF registers m's tensors with two engines and allocates the working
// memory for batches of batch sequences of seq tokens.
func NewHF(m *hfmoe.Model[float32], batch, seq int, o Options) (*HFTrainer, error) {
	if err := o.Hyper.Validate(); err != nil {
		return nil, fmt.Errorf("hf trainer: %w", err)
	}
	if o.Hyper.Amsgrad || o.Hyper.Maximize {
		return nil, fmt.Errorf("hf trainer: amsgrad and maximize are not supported")
	}
	if o.MaxGradNorm < 0 || math.IsNaN(o.MaxGradNorm) {
		return nil, fmt.Errorf("hf trainer: max grad norm %v: want >= 0", o.MaxGradNorm)
	}
	pass, err := m.NewPass(batch, seq)
	if err != nil {
		return nil, fmt.Errorf("hf trainer: %w", err)
	}
	t := &HFTrainer{m: m, pass: pass, opts: o, experts: optimizer.NewEngine(), dense: optimizer.NewEngine()}
	for _, p := range m.Params() {
		if p.Expert {
			continue
		}
		ot, err := optimizer.NewTensor(p.Name, optimizer.Float32, p.Numel(), o.Hyper, model.Bytes(p.W))
		if err != nil {
			return nil, fmt.Errorf("hf trainer: register %s: %w", p.Name, err)
		}
		t.denseT = append(t.denseT, hfDense{t: ot, p: p})
	}
	for l, ly := range m.Layers {
		gu, err := optimizer.NewTensor(ly.GateUp.Name, optimizer.Float32, ly.GateUp.Numel(), o.Hyper, model.Bytes(ly.GateUp.W))
		if err != nil {
			return nil, fmt.Errorf("hf trainer: register layer %d experts: %w", l, err)
		}
		dn, err := optimizer.NewTensor(ly.Down.Name, optimizer.Float32, ly.Down.Numel(), o.Hyper, model.Bytes(ly.Down.W))
		if err != nil {
			return nil, fmt.Errorf("hf trainer: register layer %d experts: %w", l, err)
		}
		t.layers = append(t.layers, layerTensors{gateUp: gu, down: dn})
	}
	t.mem.LayerBytes = m.ExpertBytes()
	t.mem.AllBytes = t.mem.LayerBytes * int64(len(m.Layers))
	bufs := 1
	if o.KeepAllGrads {
		bufs = len(m.Layers)
	}
	ly := m.Layers[0]
	for range bufs {
		t.gradGU = append(t.gradGU, model.AllocAt(ly.GateUp.Numel(), 3072))
		t.gradDown = append(t.gradDown, model.AllocAt(ly.Down.Numel(), 3328))
	}
	t.pending = make([]bool, len(m.Layers))
	return t, nil
}

// Memory returns the expert-gradient accounting.
func (t *HFTrainer) Memory() Memory { return t.mem }

// Model is the model being trained.
func (t *HFTrainer) Model() *hfmoe.Model[float32] { return t.m }

func (t *HFTrainer) scalars(x *optimizer.Tensor) optimizer.Scalars {
	h := t.opts.Hyper
	h.LR = t.lr
	return optimizer.ScalarsFor(h, x.Step+1)
}

// hfSink is the trainer as backward's hfmoe.ExpertGrads.
type hfSink struct{ t *HFTrainer }

func (s hfSink) Buffers(l int) ([]float32, []float32, error) {
	t := s.t
	i := 0
	if t.opts.KeepAllGrads {
		i = l
	} else if t.mem.Live > 0 {
		return nil, nil, fmt.Errorf("layer %d: the previous layer's expert gradients were not applied", l)
	}
	t.mem.alloc(t.mem.LayerBytes)
	return t.gradGU[i], t.gradDown[i], nil
}

func (s hfSink) Ready(l int, gu, down []float32) error {
	t := s.t
	if t.opts.KeepAllGrads {
		t.pending[l] = true
		return nil
	}
	if err := t.applyLayer(l, gu, down); err != nil {
		return err
	}
	t.mem.Live -= t.mem.LayerBytes
	return nil
}

func (t *HFTrainer) applyLayer(l int, gu, down []float32) error {
	lt := t.layers[l]
	if err := t.experts.Apply(lt.gateUp, model.Bytes(gu), t.scalars(lt.gateUp)); err != nil {
		return fmt.Errorf("apply %s: %w", lt.gateUp.Name, err)
	}
	if err := t.experts.Apply(lt.down, model.Bytes(down), t.scalars(lt.down)); err != nil {
		return fmt.Errorf("apply %s: %w", lt.down.Name, err)
	}
	return nil
}

// Step runs forward, backward (with the expert updates) and the dense
// update at learning rate lr. inputs and targets are batch*seq token ids;
// negative targets are not counted. StepStats.Loss is the total loss (with
// the auxiliary loss when the config enables it).
func (t *HFTrainer) Step(inputs, targets []int32, lr float64) (StepStats, error) {
	st := StepStats{LR: lr}
	if !(lr >= 0) || math.IsInf(lr, 0) {
		return st, fmt.Errorf("step: learning rate %v", lr)
	}
	t.lr = lr
	t.mem.Live = 0
	clear(t.pending)
	start := time.Now()
	loss, err := t.pass.Forward(inputs, targets)
	if err != nil {
		return st, fmt.Errorf("step: %w", err)
	}
	st.Loss = loss.Total
	fwd := time.Now()
	st.Forward = fwd.Sub(start)
	if err := t.pass.Backward(hfSink{t}); err != nil {
		return st, fmt.Errorf("step: %w", err)
	}
	bwd := time.Now()
	st.Backward = bwd.Sub(fwd)
	if t.opts.KeepAllGrads {
		for l, ok := range t.pending {
			if !ok {
				return st, fmt.Errorf("step: layer %d expert gradients never became ready", l)
			}
			if err := t.applyLayer(l, t.gradGU[l], t.gradDown[l]); err != nil {
				return st, fmt.Errorf("step: %w", err)
			}
		}
		t.mem.Live = 0
	}
	grads := make([][]float32, len(t.denseT))
	for i, d := range t.denseT {
		grads[i] = d.p.G
	}
	st.DenseGradNorm, st.ClipScale = ClipGlobalNorm(grads, t.opts.MaxGradNorm)
	for _, d := range t.denseT {
		if err := t.dense.Apply(d.t, model.Bytes(d.p.G), t.scalars(d.t)); err != nil {
			return st, fmt.Errorf("step: apply %s: %w", d.p.Name, err)
		}
	}
	st.Optimizer = time.Since(bwd)
	return st, nil
}

// Eval returns the loss on one batch without changing anything.
func (t *HFTrainer) Eval(inputs, targets []int32) (hfmoe.Loss, error) {
	loss, err := t.pass.Forward(inputs, targets)
	if err != nil {
		return loss, fmt.Errorf("eval: %w", err)
	}
	return loss, nil
}
