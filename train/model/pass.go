package model

import (
	"fmt"

	"github.com/sonar-moe/sonar/train/kernels"
	"github.com/sonar-moe/sonar/train/moe"
)

// ExpertGrads receives one layer's expert gradients during Backward.
type ExpertGrads interface {
	// Buffers returns the memory for layer l's expert gradients: gate_up
	// and down, as long as the layer's tensors. Backward overwrites them.
	Buffers(l int) (gateUp, down []float32, err error)
	// Ready is called as soon as layer l's expert gradients are final,
	// layers from last to first. From then on Backward reads neither the
	// buffers nor layer l's expert weights, so Ready may apply the optimizer
	// to the weights and release or reuse the buffers.
	Ready(l int, gateUp, down []float32) error
}

// layerActs are one block's activations, kept from forward for backward.
type layerActs struct {
	x      []float32 // block input [T, H] (the previous block's output)
	r1, r2 []float32 // RMSNorm scales [T]
	n1, n2 []float32 // normalized inputs of mixing and MoE [T, H]
	u      []float32 // mixing's convolution output [T, H]
	x1     []float32 // x + mix [T, H]
	out    []float32 // x1 + moe [T, H]
	rt     moe.Routing[float32]
	d      moe.Dispatch[float32]
}

// Pass is the working memory of forward and backward for one batch shape,
// reused from step to step.
type Pass struct {
	m          *Model
	batch, seq int
	tok, tgt   []int32
	x0         []float32 // embeddings [T, H]
	layers     []layerActs
	rf, hf     []float32 // final RMSNorm scale [T] and output [T, H]
	logits     []float32 // [T, V]; holds the loss's gradient after Forward
	// backward scratch
	dx, dx1, dn, du []float32 // [T, H]
	dw              []float32 // [T, k] gradient of routing weights
	es              moe.ExpertScratch[float32]
	forwarded       bool
}

// NewPass allocates the working memory for batches of batch sequences of
// seq tokens.
func (m *Model) NewPass(batch, seq int) (*Pass, error) {
	if batch < 1 || seq < 1 {
		return nil, fmt.Errorf("batch %d x seq %d: both must be positive", batch, seq)
	}
	c := m.Cfg
	T, h := batch*seq, c.Hidden
	f := func(n int) []float32 { return make([]float32, n) }
	p := &Pass{m: m, batch: batch, seq: seq, tok: make([]int32, T), tgt: make([]int32, T),
		x0: f(T * h), rf: f(T), hf: f(T * h), logits: f(T * c.Vocab),
		dx: f(T * h), dx1: f(T * h), dn: f(T * h), du: f(T * h), dw: f(T * c.TopK),
		es: moe.NewExpertScratch[float32](T, h, c.Intermediate, c.TopK)}
	prev := p.x0
	for range c.Layers {
		la := layerActs{x: prev, r1: f(T), r2: f(T), n1: f(T * h), n2: f(T * h), u: f(T * h), x1: f(T * h), out: f(T * h),
			rt: moe.NewRouting[float32](T, c.Experts, c.TopK, true), d: moe.NewDispatch[float32](T, h, c.Intermediate, c.Experts, c.TopK)}
		p.layers = append(p.layers, la)
		prev = la.out
	}
	return p, nil
}

// Tokens is batch*seq.
func (p *Pass) Tokens() int { return p.batch * p.seq }

// Forward runs the model on inputs and returns the mean cross-entropy of
// predicting targets (both [batch*seq] token ids, row-major by sequence).
func (p *Pass) Forward(inputs, targets []int32) (float64, error) {
	c := p.m.Cfg
	T, h := p.Tokens(), c.Hidden
	if len(inputs) != T || len(targets) != T {
		return 0, fmt.Errorf("forward: %d inputs and %d targets, want %d each", len(inputs), len(targets), T)
	}
	for i := range inputs {
		if inputs[i] < 0 || int(inputs[i]) >= c.Vocab || targets[i] < 0 || int(targets[i]) >= c.Vocab {
			return 0, fmt.Errorf("forward: token %d out of vocabulary (%d, %d)", i, inputs[i], targets[i])
		}
	}
	copy(p.tok, inputs)
	copy(p.tgt, targets)
	embedForward(p.x0, p.m.Embed.W, p.tok, h)
	for l := range p.layers {
		la, b := &p.layers[l], &p.m.Blocks[l]
		kernels.RMSNormForward(la.n1, la.r1, la.x, b.MixNorm.W, h, float64(c.NormEps))
		mixForward(la.x1, la.u, la.n1, b.MixConv.W, b.MixOut.W, p.batch, p.seq, h, c.MixWindow)
		add(la.x1, la.x)
		kernels.RMSNormForward(la.n2, la.r2, la.x1, b.MoENorm.W, h, float64(c.NormEps))
		moe.RouterForward(&la.rt, la.n2, b.Router.W, h)
		moe.ExpertsForward(la.out, la.n2, &la.rt, &la.d, b.GateUp.W, b.Down.W, h, c.Intermediate)
		add(la.out, la.x1)
	}
	last := p.x0
	if n := len(p.layers); n > 0 {
		last = p.layers[n-1].out
	}
	kernels.RMSNormForward(p.hf, p.rf, last, p.m.FinalNorm.W, h, float64(c.NormEps))
	headForward(p.logits, p.hf, p.m.Head.W, h, c.Vocab)
	p.forwarded = true
	return crossEntropy(p.logits, p.tgt, c.Vocab), nil
}

// Backward computes the gradients of the last Forward's loss. Dense
// gradients are written into each dense Param's G (overwritten). Each
// layer's expert gradients go into the buffers eg provides and are handed
// back to eg.Ready as soon as they are final, last layer first.
func (p *Pass) Backward(eg ExpertGrads) error {
	if !p.forwarded {
		return fmt.Errorf("backward: no forward to take the gradient of")
	}
	p.forwarded = false // the logits now hold the loss's gradient
	c := p.m.Cfg
	h := c.Hidden
	for _, q := range p.m.params {
		clear(q.G)
	}
	last := p.x0
	if n := len(p.layers); n > 0 {
		last = p.layers[n-1].out
	}
	clear(p.dn)
	headBackward(p.dn, p.m.Head.G, p.logits, p.hf, p.m.Head.W, h, c.Vocab)
	clear(p.dx)
	kernels.RMSNormBackward(p.dx, p.m.FinalNorm.G, p.dn, last, p.m.FinalNorm.W, p.rf, h)
	for l := len(p.layers) - 1; l >= 0; l-- {
		la, b := &p.layers[l], &p.m.Blocks[l]
		// out = x1 + experts(n2): dx flows to x1 unchanged and through the experts.
		gu, dn, err := eg.Buffers(l)
		if err != nil {
			return fmt.Errorf("backward layer %d: expert gradient buffers: %w", l, err)
		}
		if len(gu) != b.GateUp.Numel() || len(dn) != b.Down.Numel() {
			return fmt.Errorf("backward layer %d: expert gradient buffers of %d and %d elements, want %d and %d",
				l, len(gu), len(dn), b.GateUp.Numel(), b.Down.Numel())
		}
		clear(p.dn)
		moe.ExpertsBackward(p.dn, p.dw, gu, dn, &p.es, p.dx, &la.rt, &la.d, b.GateUp.W, b.Down.W, h, c.Intermediate)
		if err := eg.Ready(l, gu, dn); err != nil {
			return fmt.Errorf("backward layer %d: expert gradients: %w", l, err)
		}
		moe.RouterBackward(p.dn, b.Router.G, &la.rt, p.dw, nil, la.n2, b.Router.W, h)
		copy(p.dx1, p.dx)
		kernels.RMSNormBackward(p.dx1, b.MoENorm.G, p.dn, la.x1, b.MoENorm.W, la.r2, h)
		// x1 = x + mix(n1).
		clear(p.dn)
		mixBackward(p.dn, b.MixConv.G, b.MixOut.G, p.du, p.dx1, la.n1, la.u, b.MixConv.W, b.MixOut.W, p.batch, p.seq, h, c.MixWindow)
		copy(p.dx, p.dx1)
		kernels.RMSNormBackward(p.dx, b.MixNorm.G, p.dn, la.x, b.MixNorm.W, la.r1, h)
	}
	embedBackward(p.m.Embed.G, p.dx, p.tok, h)
	return nil
}

func add(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}
