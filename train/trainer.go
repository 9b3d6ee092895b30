// Package train is the Go-native trainer of Sonar-MoE: it binds a model
// (a Network: the byte-level model of package model, or an OLMoE or
// GraniteMoe model of package hfmoe) to the same AdamW engine sonard runs
// (package optimizer).
// Expert tensors are optimizer.Tensors over the model's weight memory; each
// layer's expert gradients are applied the moment backward has made them
// final, last layer first, and their buffer is reused for the next layer, so
// at most one layer of expert gradients is alive. Dense parameters are a
// second set of optimizer.Tensors stepped after backward, with global-norm
// clipping over the dense gradients only. With KeepAllGrads the trainer is
// the standard baseline instead: every expert gradient is kept until backward
// ends and then applied, which gives bit-for-bit the same parameters.
package train

import (
	"fmt"
	"math"
	"time"

	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/train/kernels"
)

// Options configure a Trainer.
type Options struct {
	// Hyper are AdamW's hyper-parameters for every tensor; the LR of each
	// step is passed to Step (a schedule), Hyper.LR is only its default.
	Hyper optimizer.Hyper
	// MaxGradNorm clips the dense gradients to this global L2 norm, as
	// torch.nn.utils.clip_grad_norm_ over the dense parameters; 0: no
	// clipping. Expert gradients are never clipped (they are applied before
	// the norm is known).
	MaxGradNorm float64
	// KeepAllGrads keeps every layer's expert gradients until backward has
	// finished and applies them afterwards: standard training, the baseline
	// for memory and speed.
	KeepAllGrads bool
}

// DefaultHyper are torch.optim.AdamW's defaults with a learning rate for
// this small model.
func DefaultHyper() optimizer.Hyper {
	return optimizer.Hyper{LR: 3e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
}

// Memory is the expert-gradient memory accounting: bytes of expert
// gradients alive (handed out by the trainer and not yet applied and freed).
type Memory struct {
	Live       int64 // now
	Peak       int64 // at most, since the trainer was made
	LayerBytes int64 // one layer's expert gradients
	AllBytes   int64 // every layer's
}

func (m *Memory) alloc(n int64) {
	m.Live += n
	m.Peak = max(m.Peak, m.Live)
}

// StepStats describe one training step.
type StepStats struct {
	Loss          float64
	DenseGradNorm float64 // global norm of the dense gradients, before clipping
	ClipScale     float64 // factor applied to the dense gradients (1: not clipped)
	LR            float64
	Forward       time.Duration
	Backward      time.Duration // includes the expert updates in the default mode
	Optimizer     time.Duration // updates after backward: dense, and experts with KeepAllGrads
}

type layerTensors struct {
	gateUp, down *optimizer.Tensor
}

type denseTensor struct {
	t *optimizer.Tensor
	p Tensor
}

// Trainer trains a Network with per-layer expert updates in backward.
type Trainer struct {
	net     Network
	opts    Options
	experts *optimizer.Engine // expert tensors, stepped during backward
	dense   *optimizer.Engine // dense tensors, stepped after backward
	layers  []layerTensors
	expertW [][2]Tensor // each layer's expert tensors (weights only)
	denseT  []denseTensor
	mem     Memory
	lr      float64 // LR of the step in progress

	// Expert gradient memory: one layer-sized buffer reused by every layer,
	// or with KeepAllGrads one buffer per layer.
	gradGU, gradDown [][]float32
	pending          []bool // layers whose gradients wait for the step (KeepAllGrads)

	onBuffers func(l int) // test hook: called when backward asks for layer l's buffers
}

// NewTrainer registers the network's tensors with two engines: the expert
// tensors with one stepped during backward, the dense ones with one stepped
// after it.
func NewTrainer(net Network, o Options) (*Trainer, error) {
	if err := o.Hyper.Validate(); err != nil {
		return nil, fmt.Errorf("trainer: %w", err)
	}
	if o.Hyper.Amsgrad || o.Hyper.Maximize {
		return nil, fmt.Errorf("trainer: amsgrad and maximize are not supported")
	}
	if o.MaxGradNorm < 0 || math.IsNaN(o.MaxGradNorm) {
		return nil, fmt.Errorf("trainer: max grad norm %v: want >= 0", o.MaxGradNorm)
	}
	experts := net.Experts()
	if len(experts) == 0 {
		return nil, fmt.Errorf("trainer: the model has no expert layer")
	}
	t := &Trainer{net: net, opts: o, experts: optimizer.NewEngine(), dense: optimizer.NewEngine(), expertW: experts}
	for _, p := range net.Dense() {
		ot, err := optimizer.NewTensor(p.Name, optimizer.Float32, len(p.W), o.Hyper, kernels.Bytes(p.W))
		if err != nil {
			return nil, fmt.Errorf("trainer: register %s: %w", p.Name, err)
		}
		t.denseT = append(t.denseT, denseTensor{t: ot, p: p})
	}
	for l, pair := range experts {
		var lt [2]*optimizer.Tensor
		for i, x := range pair {
			ot, err := optimizer.NewTensor(x.Name, optimizer.Float32, len(x.W), o.Hyper, kernels.Bytes(x.W))
			if err != nil {
				return nil, fmt.Errorf("trainer: register layer %d experts: %w", l, err)
			}
			lt[i] = ot
		}
		t.layers = append(t.layers, layerTensors{gateUp: lt[0], down: lt[1]})
	}
	gu, dn := len(experts[0][0].W), len(experts[0][1].W)
	t.mem.LayerBytes = 4 * int64(gu+dn)
	t.mem.AllBytes = t.mem.LayerBytes * int64(len(experts))
	bufs := 1
	if o.KeepAllGrads {
		bufs = len(experts)
	}
	for range bufs {
		// Offsets apart from the weights' and the optimizer state's (see kernels.AllocAt).
		t.gradGU = append(t.gradGU, kernels.AllocAt[float32](gu, 3072))
		t.gradDown = append(t.gradDown, kernels.AllocAt[float32](dn, 3328))
	}
	t.pending = make([]bool, len(experts))
	return t, nil
}

// Weights lists the weights of every tensor the trainer steps: the dense
// ones, then each layer's gate_up and down.
func (t *Trainer) Weights() [][]float32 {
	var out [][]float32
	for _, d := range t.denseT {
		out = append(out, d.p.W)
	}
	for _, pair := range t.expertW {
		out = append(out, pair[0].W, pair[1].W)
	}
	return out
}

// Memory returns the expert-gradient accounting.
func (t *Trainer) Memory() Memory { return t.mem }

// ExpertTensors returns the optimizer tensors of each layer's experts
// (gate_up, down), whose Param is the model's weight memory.
func (t *Trainer) ExpertTensors() [][2]*optimizer.Tensor {
	out := make([][2]*optimizer.Tensor, len(t.layers))
	for i, l := range t.layers {
		out[i] = [2]*optimizer.Tensor{l.gateUp, l.down}
	}
	return out
}

// scalars are the AdamW constants of tensor x's next step at the current LR.
func (t *Trainer) scalars(x *optimizer.Tensor) optimizer.Scalars {
	h := t.opts.Hyper
	h.LR = t.lr
	return optimizer.ScalarsFor(h, x.Step+1)
}

// sink is the trainer as backward's ExpertGrads.
type sink struct{ t *Trainer }

func (s sink) Buffers(l int) ([]float32, []float32, error) { return s.t.buffers(l) }
func (s sink) Ready(l int, gu, down []float32) error       { return s.t.ready(l, gu, down) }

// buffers hands out layer l's expert-gradient memory.
func (t *Trainer) buffers(l int) ([]float32, []float32, error) {
	i := 0
	if t.opts.KeepAllGrads {
		i = l
	}
	if l < 0 || l >= len(t.layers) {
		return nil, nil, fmt.Errorf("layer %d: the model has %d expert layers", l, len(t.layers))
	}
	if t.mem.Live > 0 && !t.opts.KeepAllGrads {
		return nil, nil, fmt.Errorf("layer %d: the previous layer's expert gradients were not applied", l)
	}
	if t.onBuffers != nil {
		t.onBuffers(l)
	}
	t.mem.alloc(t.mem.LayerBytes)
	return t.gradGU[i], t.gradDown[i], nil
}

// ready takes layer l's final expert gradients: by default it applies
// AdamW to the layer's expert tensors at once and frees the gradients; with
// KeepAllGrads it keeps them for after backward.
func (t *Trainer) ready(l int, gu, down []float32) error {
	if l < 0 || l >= len(t.layers) {
		return fmt.Errorf("layer %d: the model has %d expert layers", l, len(t.layers))
	}
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

func (t *Trainer) applyLayer(l int, gu, down []float32) error {
	lt := t.layers[l]
	if err := t.experts.Apply(lt.gateUp, kernels.Bytes(gu), t.scalars(lt.gateUp)); err != nil {
		return fmt.Errorf("apply %s: %w", lt.gateUp.Name, err)
	}
	if err := t.experts.Apply(lt.down, kernels.Bytes(down), t.scalars(lt.down)); err != nil {
		return fmt.Errorf("apply %s: %w", lt.down.Name, err)
	}
	return nil
}

// Step runs forward, backward (with the expert updates) and the dense
// update at learning rate lr, on inputs and targets of batch*seq tokens
// (negative targets are not counted). StepStats.Loss is the total loss
// (with the auxiliary loss when the model has one).
func (t *Trainer) Step(inputs, targets []int32, lr float64) (StepStats, error) {
	st := StepStats{LR: lr}
	if !(lr >= 0) || math.IsInf(lr, 0) {
		return st, fmt.Errorf("step: learning rate %v", lr)
	}
	t.lr = lr
	t.mem.Live = 0 // nothing is alive between steps (a failed step's buffers are reused)
	clear(t.pending)
	start := time.Now()
	loss, err := t.net.Forward(inputs, targets)
	if err != nil {
		return st, fmt.Errorf("step: %w", err)
	}
	st.Loss = loss.Total
	fwd := time.Now()
	st.Forward = fwd.Sub(start)
	if err := t.net.Backward(sink{t}); err != nil {
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
			t.pending[l] = false
		}
		t.mem.Live = 0
	}
	st.DenseGradNorm, st.ClipScale = t.clipDense()
	for _, d := range t.denseT {
		if err := t.dense.Apply(d.t, kernels.Bytes(d.p.G), t.scalars(d.t)); err != nil {
			return st, fmt.Errorf("step: apply %s: %w", d.p.Name, err)
		}
	}
	st.Optimizer = time.Since(bwd)
	return st, nil
}

// clipDense scales the dense gradients so that their global L2 norm is at
// most MaxGradNorm, as torch's clip_grad_norm_ does: scale = max_norm /
// (norm + 1e-6) when that is below 1. It returns the norm before clipping
// and the scale applied.
func (t *Trainer) clipDense() (norm, scale float64) {
	grads := make([][]float32, len(t.denseT))
	for i, d := range t.denseT {
		grads[i] = d.p.G
	}
	return ClipGlobalNorm(grads, t.opts.MaxGradNorm)
}

// ClipGlobalNorm computes the L2 norm of all of grads together (in float64)
// and, when maxNorm > 0 and maxNorm/(norm+1e-6) < 1, multiplies every
// gradient by that factor (rounded to float32, as torch multiplies by a
// float32 tensor). It returns the norm and the factor (1 when unchanged).
func ClipGlobalNorm(grads [][]float32, maxNorm float64) (norm, scale float64) {
	var ss float64
	for _, g := range grads {
		for _, v := range g {
			ss += float64(v) * float64(v)
		}
	}
	norm = math.Sqrt(ss)
	scale = 1
	if maxNorm <= 0 {
		return norm, scale
	}
	if c := maxNorm / (norm + 1e-6); c < 1 {
		f := float32(c)
		for _, g := range grads {
			for i := range g {
				g[i] *= f
			}
		}
		scale = float64(f)
	}
	return norm, scale
}

// Eval returns the loss on one batch without changing anything.
func (t *Trainer) Eval(inputs, targets []int32) (Loss, error) {
	loss, err := t.net.Forward(inputs, targets)
	if err != nil {
		return loss, fmt.Errorf("eval: %w", err)
	}
	return loss, nil
}
