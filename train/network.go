package train

import (
	"fmt"

	"github.com/sonar-moe/sonar/train/hfmoe"
	"github.com/sonar-moe/sonar/train/model"
)

// Network is what a Trainer trains: a model with the working memory of one
// batch shape. NewNetwork adapts the byte-level model (package model),
// NewHFNetwork an OLMoE or GraniteMoe model (package hfmoe).
type Network interface {
	// Dense lists every parameter that is not an expert tensor, with the
	// memory Backward writes its gradient into.
	Dense() []Tensor
	// Experts lists each layer's batched expert tensors, gate_up [E, 2I, H]
	// and down [E, H, I], without gradients: Backward hands those to an
	// ExpertGrads one layer at a time.
	Experts() [][2]Tensor
	// Forward computes the loss of predicting targets from inputs (batch *
	// seq token ids; negative targets are not counted).
	Forward(inputs, targets []int32) (Loss, error)
	// Backward takes the gradient of the last Forward's Total: dense ones
	// into each Tensor's G (overwritten), each layer's expert ones into the
	// buffers eg lends, handed back the moment they are final, last layer
	// first.
	Backward(eg ExpertGrads) error
}

// Tensor is a parameter's float32 weights and, for dense ones, gradient.
type Tensor struct {
	Name string
	W, G []float32
}

// Loss is a forward pass's loss: Total is what backward differentiates, CE
// the mean next-token cross-entropy alone (Total less the auxiliary
// load-balancing loss, when the model has one).
type Loss struct{ Total, CE float64 }

// ExpertGrads is how Backward borrows and hands back a layer's expert
// gradient memory (model.ExpertGrads, hfmoe.ExpertGrads[float32]).
type ExpertGrads interface {
	Buffers(l int) (gateUp, down []float32, err error)
	Ready(l int, gateUp, down []float32) error
}

// byteNet is the byte-level model as a Network.
type byteNet struct {
	m *model.Model
	p *model.Pass
}

// NewNetwork adapts m with the working memory for batches of batch
// sequences of seq bytes.
func NewNetwork(m *model.Model, batch, seq int) (Network, error) {
	p, err := m.NewPass(batch, seq)
	if err != nil {
		return nil, err
	}
	return byteNet{m: m, p: p}, nil
}

func (n byteNet) Dense() []Tensor {
	var out []Tensor
	for _, p := range n.m.Params() {
		if !p.Expert {
			out = append(out, Tensor{Name: p.Name, W: p.W, G: p.G})
		}
	}
	return out
}

func (n byteNet) Experts() [][2]Tensor {
	var out [][2]Tensor
	for _, b := range n.m.Blocks {
		out = append(out, [2]Tensor{{Name: b.GateUp.Name, W: b.GateUp.W}, {Name: b.Down.Name, W: b.Down.W}})
	}
	return out
}

func (n byteNet) Forward(inputs, targets []int32) (Loss, error) {
	l, err := n.p.Forward(inputs, targets)
	return Loss{Total: l, CE: l}, err
}

func (n byteNet) Backward(eg ExpertGrads) error { return n.p.Backward(eg) }

// hfNet is an OLMoE or GraniteMoe model as a Network.
type hfNet struct {
	m *hfmoe.Model[float32]
	p *hfmoe.Pass[float32]
}

// NewHFNetwork adapts m with the working memory for batches of batch
// sequences of seq tokens.
func NewHFNetwork(m *hfmoe.Model[float32], batch, seq int) (Network, error) {
	p, err := m.NewPass(batch, seq)
	if err != nil {
		return nil, err
	}
	return hfNet{m: m, p: p}, nil
}

func (n hfNet) Dense() []Tensor {
	var out []Tensor
	for _, p := range n.m.Params() {
		if !p.Expert {
			out = append(out, Tensor{Name: p.Name, W: p.W, G: p.G})
		}
	}
	return out
}

func (n hfNet) Experts() [][2]Tensor {
	var out [][2]Tensor
	for _, l := range n.m.Layers {
		out = append(out, [2]Tensor{{Name: l.GateUp.Name, W: l.GateUp.W}, {Name: l.Down.Name, W: l.Down.W}})
	}
	return out
}

func (n hfNet) Forward(inputs, targets []int32) (Loss, error) {
	l, err := n.p.Forward(inputs, targets)
	return Loss{Total: l.Total, CE: l.CE}, err
}

func (n hfNet) Backward(eg ExpertGrads) error { return n.p.Backward(eg) }

// New trains the byte-level model m on batches of batch sequences of seq
// bytes.
func New(m *model.Model, batch, seq int, o Options) (*Trainer, error) {
	n, err := NewNetwork(m, batch, seq)
	if err != nil {
		return nil, fmt.Errorf("trainer: %w", err)
	}
	return NewTrainer(n, o)
}

// NewHF fine-tunes an OLMoE or GraniteMoe model m (float32) on batches of
// batch sequences of seq tokens.
func NewHF(m *hfmoe.Model[float32], batch, seq int, o Options) (*Trainer, error) {
	n, err := NewHFNetwork(m, batch, seq)
	if err != nil {
		return nil, fmt.Errorf("trainer: %w", err)
	}
	return NewTrainer(n, o)
}
