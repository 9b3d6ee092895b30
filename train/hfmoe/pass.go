package hfmoe

import (
	"fmt"

	"github.com/sonar-moe/sonar/train/kernels"
	"github.com/sonar-moe/sonar/train/moe"
)

// ExpertGrads receives one layer's expert gradients during Backward.
type ExpertGrads[F Float] interface {
	// Buffers returns the memory for layer l's expert gradients (gate_up
	// and down, as long as the layer's tensors); Backward overwrites it.
	Buffers(l int) (gateUp, down []F, err error)
	// Ready is called as soon as layer l's expert gradients are final,
	// layers from last to first. From then on Backward reads neither the
	// buffers nor layer l's expert weights: Ready may update the weights
	// and reuse the buffers.
	Ready(l int, gateUp, down []F) error
}

// layerActs are one layer's activations, kept from forward for backward.
type layerActs[F Float] struct {
	x          []F // layer input [T, H] (the previous layer's output)
	r1, r2     []F // RMSNorm scales [T]
	n1, n2     []F // normalized inputs of attention and MoE [T, H]
	q, k, v    []F // projections before q/k norm [T, H], [T, KV], [T, KV]
	rq, rk     []F // q/k norm scales [T]
	qr, kr     []F // normalized and rotated queries and keys
	p          []F // attention probabilities [B, heads, S, S]
	att        []F // attention output before o_proj [T, H]
	x1         []F // x + attention [T, H]
	out        []F // x1 + MoE [T, H]
	rt         moe.Routing[F]
	d          moe.Dispatch[F]
	expertRows []int // tokens routed to each expert (for the auxiliary loss)
}

// Loss is the result of a forward pass.
type Loss struct {
	Total float64 // CE + RouterAuxCoef * Aux when the config enables the auxiliary loss, else CE
	CE    float64 // mean next-token cross-entropy over the counted targets
	Aux   float64 // load-balancing loss (computed either way)
	Count int     // targets counted
}

// Pass is the working memory of forward and backward for one batch shape,
// reused from step to step.
type Pass[F Float] struct {
	m          *Model[F]
	batch, seq int
	attn       attnShape
	tok, tgt   []int32
	cos, sin   []F
	x0         []F
	layers     []layerActs[F]
	rf, hf     []F
	logits     []F // [T, V]; the loss's gradient after Backward
	lse        []float64
	loss       Loss
	auxGrad    []F // [E] gradient of the loss w.r.t. every token's router probabilities
	// backward scratch
	dx, dx1, dn, datt, dq, dqp []F
	dres                       []F // a residual branch's gradient times residual_multiplier
	dk, dv, dkp                []F
	dp                         []F
	dw                         []F
	es                         moe.ExpertScratch[F]
	forwarded                  bool
}

// NewPass allocates the working memory for batches of batch sequences of
// seq tokens.
func (m *Model[F]) NewPass(batch, seq int) (*Pass[F], error) {
	if batch < 1 || seq < 1 {
		return nil, fmt.Errorf("hfmoe: batch %d x seq %d: both must be positive", batch, seq)
	}
	c := m.Cfg
	T, h, kv, hd := batch*seq, c.Hidden, c.KVDim(), c.HeadDim()
	f := func(n int) []F { return make([]F, n) }
	pp := batch * c.Heads * seq * seq
	p := &Pass[F]{m: m, batch: batch, seq: seq,
		attn: attnShape{batch: batch, seq: seq, heads: c.Heads, kvHeads: c.KVHeads, d: hd, scale: c.attnScale()},
		dres: f(T * h),
		tok:  make([]int32, T), tgt: make([]int32, T), x0: f(T * h), rf: f(T), hf: f(T * h),
		logits: f(T * c.Vocab), lse: make([]float64, T), auxGrad: f(c.Experts),
		dx: f(T * h), dx1: f(T * h), dn: f(T * h), datt: f(T * h), dq: f(T * h), dqp: f(T * h),
		dk: f(T * kv), dv: f(T * kv), dkp: f(T * kv), dp: f(pp), dw: f(T * c.TopK),
		es: moe.NewExpertScratch[F](T, h, c.Intermediate, c.TopK)}
	p.cos, p.sin = ropeTables[F](seq, hd, c.RopeTheta)
	prev := p.x0
	for range c.Layers {
		la := layerActs[F]{x: prev, r1: f(T), r2: f(T), n1: f(T * h), n2: f(T * h),
			q: f(T * h), k: f(T * kv), v: f(T * kv), rq: f(T), rk: f(T), qr: f(T * h), kr: f(T * kv),
			p: f(pp), att: f(T * h), x1: f(T * h), out: f(T * h),
			rt: moe.NewRouting[F](T, c.Experts, c.TopK, c.NormTopKProb), d: moe.NewDispatch[F](T, h, c.Intermediate, c.Experts, c.TopK),
			expertRows: make([]int, c.Experts)}
		p.layers = append(p.layers, la)
		prev = la.out
	}
	return p, nil
}

// Tokens is batch*seq.
func (p *Pass[F]) Tokens() int { return p.batch * p.seq }

// Logits are the last Forward's logits [batch*seq, vocab], valid until
// Backward (which turns them into their gradient).
func (p *Pass[F]) Logits() []F { return p.logits }

// Forward runs the model on inputs [batch*seq] (each row one sequence,
// positions 0..seq-1, causal attention within the row) and returns the loss
// of predicting targets (negative targets are not counted, as labels of
// -100). For transformers' labels=input_ids, targets are the inputs shifted
// left by one within each row, the last position -1.
func (p *Pass[F]) Forward(inputs, targets []int32) (Loss, error) {
	c := p.m.Cfg
	T, h, kv := p.Tokens(), c.Hidden, c.KVDim()
	if len(inputs) != T || len(targets) != T {
		return Loss{}, fmt.Errorf("hfmoe forward: %d inputs and %d targets, want %d each", len(inputs), len(targets), T)
	}
	for i := range inputs {
		if inputs[i] < 0 || int(inputs[i]) >= c.Vocab || int(targets[i]) >= c.Vocab {
			return Loss{}, fmt.Errorf("hfmoe forward: position %d: token %d or target %d outside the vocabulary (%d)", i, inputs[i], targets[i], c.Vocab)
		}
	}
	copy(p.tok, inputs)
	copy(p.tgt, targets)
	emb := p.m.Embed.W
	for t, id := range p.tok {
		copy(p.x0[t*h:(t+1)*h], emb[int(id)*h:(int(id)+1)*h])
	}
	scale(p.x0, c.EmbeddingMultiplier)
	eps := c.NormEps
	for l := range p.layers {
		la, b := &p.layers[l], &p.m.Layers[l]
		kernels.RMSNormForward(la.n1, la.r1, la.x, b.InNorm.W, h, eps)
		kernels.Gemm(false, true, T, h, h, la.n1, h, b.Q.W, h, 0, la.q, h)
		kernels.Gemm(false, true, T, kv, h, la.n1, h, b.K.W, h, 0, la.k, kv)
		kernels.Gemm(false, true, T, kv, h, la.n1, h, b.V.W, h, 0, la.v, kv)
		if c.QKNorm() {
			kernels.RMSNormForward(la.qr, la.rq, la.q, b.QNorm.W, h, eps)
			kernels.RMSNormForward(la.kr, la.rk, la.k, b.KNorm.W, kv, eps)
		} else {
			copy(la.qr, la.q)
			copy(la.kr, la.k)
		}
		ropeForward(la.qr, p.cos, p.sin, p.seq, h, p.attn.d)
		ropeForward(la.kr, p.cos, p.sin, p.seq, kv, p.attn.d)
		attentionForward(la.att, la.p, la.qr, la.kr, la.v, p.attn)
		kernels.Gemm(false, true, T, h, h, la.att, h, b.O.W, h, 0, la.x1, h)
		scale(la.x1, c.ResidualMultiplier)
		add(la.x1, la.x)
		kernels.RMSNormForward(la.n2, la.r2, la.x1, b.PostNorm.W, h, eps)
		moe.RouterForward(&la.rt, la.n2, b.Router.W, h)
		moe.ExpertsForward(la.out, la.n2, &la.rt, &la.d, b.GateUp.W, b.Down.W, h, c.Intermediate)
		scale(la.out, c.ResidualMultiplier)
		add(la.out, la.x1)
		for e := range la.expertRows {
			la.expertRows[e] = la.d.Rows(e)
		}
	}
	last := p.x0
	if n := len(p.layers); n > 0 {
		last = p.layers[n-1].out
	}
	kernels.RMSNormForward(p.hf, p.rf, last, p.m.FinalNorm.W, h, eps)
	kernels.Gemm(false, true, T, c.Vocab, h, p.hf, h, p.m.Head.W, h, 0, p.logits, c.Vocab)
	if ls := c.LogitsScaling; ls != 0 && ls != 1 {
		for i := range p.logits {
			p.logits[i] /= F(ls)
		}
	}
	ce, n := crossEntropy(p.logits, p.lse, p.tgt, c.Vocab)
	if n == 0 {
		return Loss{}, fmt.Errorf("hfmoe forward: no target to predict")
	}
	p.loss = Loss{CE: ce, Total: ce, Count: n}
	p.loss.Aux = p.auxLoss()
	if c.AuxLoss {
		p.loss.Total += c.RouterAuxCoef * p.loss.Aux
	}
	p.forwarded = true
	return p.loss, nil
}

// auxLoss is OLMoE's load-balancing loss over all layers together: with
// f_e the fraction of (token, slot) pairs routed to expert e and P_e the
// mean router probability of e, both over every layer and token, aux = E *
// sum_e f_e P_e (f_e sums to top-k). It also sets auxGrad, the loss's
// gradient w.r.t. each probability: coef * E * f_e / (layers * T).
func (p *Pass[F]) auxLoss() float64 {
	c := p.m.Cfg
	rows := float64(len(p.layers) * p.Tokens())
	var aux float64
	for e := range c.Experts {
		var cnt, ps float64
		for l := range p.layers {
			la := &p.layers[l]
			cnt += float64(la.expertRows[e])
			for t := range p.Tokens() {
				ps += float64(la.rt.Probs[t*c.Experts+e])
			}
		}
		f := cnt / rows
		aux += f * ps / rows
		p.auxGrad[e] = F(c.RouterAuxCoef * float64(c.Experts) * f / rows)
	}
	return aux * float64(c.Experts)
}

// Backward computes the gradients of the last Forward's total loss. Dense
// gradients are written into each dense Param's G (overwritten). Each
// layer's expert gradients go into the buffers eg provides and are handed
// back to eg.Ready as soon as they are final, last layer first.
func (p *Pass[F]) Backward(eg ExpertGrads[F]) error {
	if !p.forwarded {
		return fmt.Errorf("hfmoe backward: no forward to take the gradient of")
	}
	p.forwarded = false
	c := p.m.Cfg
	T, h, kv, v := p.Tokens(), c.Hidden, c.KVDim(), c.Vocab
	for _, q := range p.m.params {
		clear(q.G)
	}
	var aux []F
	if c.AuxLoss {
		aux = p.auxGrad
	}
	last := p.x0
	if n := len(p.layers); n > 0 {
		last = p.layers[n-1].out
	}
	crossEntropyBackward(p.logits, p.lse, p.tgt, v, p.loss.Count, 1)
	if ls := c.LogitsScaling; ls != 0 && ls != 1 {
		for i := range p.logits {
			p.logits[i] /= F(ls)
		}
	}
	kernels.Gemm(true, false, v, h, T, p.logits, v, p.hf, h, 1, p.m.Head.G, h)  // dHead += dlogits^T hf
	kernels.Gemm(false, false, T, h, v, p.logits, v, p.m.Head.W, h, 0, p.dn, h) // dhf = dlogits Head
	clear(p.dx)
	kernels.RMSNormBackward(p.dx, p.m.FinalNorm.G, p.dn, last, p.m.FinalNorm.W, p.rf, h)
	for l := len(p.layers) - 1; l >= 0; l-- {
		la, b := &p.layers[l], &p.m.Layers[l]
		// out = x1 + MoE(n2).
		gu, dn, err := eg.Buffers(l)
		if err != nil {
			return fmt.Errorf("hfmoe backward layer %d: expert gradient buffers: %w", l, err)
		}
		if len(gu) != b.GateUp.Numel() || len(dn) != b.Down.Numel() {
			return fmt.Errorf("hfmoe backward layer %d: expert gradient buffers of %d and %d elements, want %d and %d",
				l, len(gu), len(dn), b.GateUp.Numel(), b.Down.Numel())
		}
		clear(p.dn)
		dmoe := scaled(p.dres, p.dx, c.ResidualMultiplier)
		moe.ExpertsBackward(p.dn, p.dw, gu, dn, &p.es, dmoe, &la.rt, &la.d, b.GateUp.W, b.Down.W, h, c.Intermediate)
		if err := eg.Ready(l, gu, dn); err != nil {
			return fmt.Errorf("hfmoe backward layer %d: expert gradients: %w", l, err)
		}
		moe.RouterBackward(p.dn, b.Router.G, &la.rt, p.dw, aux, la.n2, b.Router.W, h)
		copy(p.dx1, p.dx)
		kernels.RMSNormBackward(p.dx1, b.PostNorm.G, p.dn, la.x1, b.PostNorm.W, la.r2, h)
		// x1 = x + o_proj(attention(n1)).
		do := scaled(p.dres, p.dx1, c.ResidualMultiplier)
		kernels.Gemm(true, false, h, h, T, do, h, la.att, h, 1, b.O.G, h)  // dWo += do^T att
		kernels.Gemm(false, false, T, h, h, do, h, b.O.W, h, 0, p.datt, h) // datt = do Wo
		clear(p.dk)
		clear(p.dv)
		attentionBackward(p.dq, p.dk, p.dv, p.dp, p.datt, la.p, la.qr, la.kr, la.v, p.attn)
		ropeBackward(p.dq, p.cos, p.sin, p.seq, h, p.attn.d)
		ropeBackward(p.dk, p.cos, p.sin, p.seq, kv, p.attn.d)
		if c.QKNorm() {
			clear(p.dqp)
			kernels.RMSNormBackward(p.dqp, b.QNorm.G, p.dq, la.q, b.QNorm.W, la.rq, h)
			clear(p.dkp)
			kernels.RMSNormBackward(p.dkp, b.KNorm.G, p.dk, la.k, b.KNorm.W, la.rk, kv)
		} else {
			copy(p.dqp, p.dq)
			copy(p.dkp, p.dk)
		}
		kernels.Gemm(true, false, h, h, T, p.dqp, h, la.n1, h, 1, b.Q.G, h)
		kernels.Gemm(true, false, kv, h, T, p.dkp, kv, la.n1, h, 1, b.K.G, h)
		kernels.Gemm(true, false, kv, h, T, p.dv, kv, la.n1, h, 1, b.V.G, h)
		kernels.Gemm(false, false, T, h, h, p.dqp, h, b.Q.W, h, 0, p.dn, h)
		kernels.Gemm(false, false, T, h, kv, p.dkp, kv, b.K.W, h, 1, p.dn, h)
		kernels.Gemm(false, false, T, h, kv, p.dv, kv, b.V.W, h, 1, p.dn, h)
		copy(p.dx, p.dx1)
		kernels.RMSNormBackward(p.dx, b.InNorm.G, p.dn, la.x, b.InNorm.W, la.r1, h)
	}
	g := p.m.Embed.G
	scale(p.dx, c.EmbeddingMultiplier)
	for t, id := range p.tok {
		if int(id) == c.PadTokenID {
			continue // nn.Embedding(padding_idx) gives its row no gradient
		}
		gt := g[int(id)*h : (int(id)+1)*h]
		for j, x := range p.dx[t*h : (t+1)*h] {
			gt[j] += x
		}
	}
	return nil
}

// scale multiplies x by m unless m is 0 (absent) or 1.
func scale[F Float](x []F, m float64) {
	if m == 0 || m == 1 {
		return
	}
	for i := range x {
		x[i] *= F(m)
	}
}

// scaled returns g times m, in buf, or g itself when m is 0 (absent) or 1.
func scaled[F Float](buf, g []F, m float64) []F {
	if m == 0 || m == 1 {
		return g
	}
	for i, v := range g {
		buf[i] = v * F(m)
	}
	return buf
}

func add[F Float](dst, src []F) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}
