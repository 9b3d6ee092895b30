// Package moe is the Mixture-of-Experts layer that the Go models of
// Sonar-MoE share (train/model, the byte-level model; train/hfmoe, OLMoE and
// GraniteMoe), forward and backward, generic over float32 (training) and
// float64 (gradient checks): a softmax router with top-k choice (the chosen
// probabilities renormalized when norm_topk_prob is set) and an optional
// load-balancing gradient, the dispatch of (token, slot) pairs to experts,
// and SiLU-gated experts in the batched layout of transformers 5.x OLMoE
// (gate_up [E, 2I, H], gate rows first; down [E, H, I]), each expert's rows
// as dense matrix products (package kernels), the experts in parallel.
package moe

import (
	"math"

	"github.com/sonar-moe/sonar/train/kernels"
)

// Float is the element type of a model (kernels.Float).
type Float = kernels.Float

// Routing is the router's decision for T tokens: softmax probabilities over
// the E experts, the top-k experts of each token (highest probability first,
// ties to the lower index) and their weights, the chosen probabilities,
// renormalized to sum to one when norm is set (norm_topk_prob).
type Routing[F Float] struct {
	e, k   int
	norm   bool
	Logits []F     // [T, E]; backward reuses it for the logits' gradient
	Probs  []F     // [T, E]
	Idx    []int32 // [T, k]
	W      []F     // [T, k]
}

// NewRouting allocates the routing of tokens tokens over e experts, k of
// them a token; norm renormalizes the chosen probabilities.
func NewRouting[F Float](tokens, e, k int, norm bool) Routing[F] {
	return Routing[F]{e: e, k: k, norm: norm, Logits: make([]F, tokens*e), Probs: make([]F, tokens*e),
		Idx: make([]int32, tokens*k), W: make([]F, tokens*k)}
}

// RouterForward routes the rows of x [T, h] with router weights wr [E, h].
func RouterForward[F Float](rt *Routing[F], x, wr []F, h int) {
	e, k := rt.e, rt.k
	tokens := len(rt.Idx) / k
	kernels.Gemm(false, true, tokens, e, h, x, h, wr, h, 0, rt.Logits, e)
	for t := range tokens {
		lg, p := rt.Logits[t*e:(t+1)*e], rt.Probs[t*e:(t+1)*e]
		mx := math.Inf(-1)
		for _, v := range lg {
			mx = max(mx, float64(v))
		}
		var sum float64
		for _, v := range lg {
			sum += math.Exp(float64(v) - mx)
		}
		for j, v := range lg {
			p[j] = F(math.Exp(float64(v)-mx) / sum)
		}
		idx, w := rt.Idx[t*k:(t+1)*k], rt.W[t*k:(t+1)*k]
		TopK(idx, p)
		var s F
		for j, id := range idx {
			w[j] = p[id]
			s += w[j]
		}
		if rt.norm {
			for j := range w {
				w[j] /= s
			}
		}
	}
}

// TopK writes the indices of the len(idx) largest values of p into idx,
// largest first; equal values keep index order.
func TopK[F Float](idx []int32, p []F) {
	n := 0
	for i, v := range p {
		pos := n
		for pos > 0 && p[idx[pos-1]] < v {
			pos--
		}
		if pos >= len(idx) {
			continue
		}
		if n < len(idx) {
			n++
		}
		copy(idx[pos+1:n], idx[pos:n-1])
		idx[pos] = int32(i)
	}
}

// RouterBackward takes the gradient of the routing weights dw [T, k] and,
// when aux is not nil, a gradient aux [E] added to every token's
// probabilities (the load-balancing loss's), back through the top-k
// (renormalization) and the softmax, and adds the gradients of the router's
// input to dx [T, h] and of its weights to dwr. The top-k choice itself is
// piecewise constant and has no gradient.
func RouterBackward[F Float](dx, dwr []F, rt *Routing[F], dw, aux, x, wr []F, h int) {
	e, k := rt.e, rt.k
	tokens := len(rt.Idx) / k
	dl := rt.Logits // the logits are not needed any more
	for t := range tokens {
		p, d := rt.Probs[t*e:(t+1)*e], dl[t*e:(t+1)*e]
		idx, w, dwt := rt.Idx[t*k:(t+1)*k], rt.W[t*k:(t+1)*k], dw[t*k:(t+1)*k]
		if aux != nil {
			copy(d, aux)
		} else {
			clear(d)
		}
		if rt.norm {
			// w_j = p_j / S, S = sum of the chosen p: dp_m += (dw_m - sum_j dw_j w_j) / S.
			var s, dot F
			for j, id := range idx {
				s += p[id]
				dot += dwt[j] * w[j]
			}
			for j, id := range idx {
				d[id] += (dwt[j] - dot) / s
			}
		} else {
			for j, id := range idx {
				d[id] += dwt[j]
			}
		}
		// Softmax: dlogit_i = p_i (dp_i - sum_m dp_m p_m).
		var pd float64
		for i := range d {
			pd += float64(d[i]) * float64(p[i])
		}
		for i := range d {
			d[i] = p[i] * (d[i] - F(pd))
		}
	}
	kernels.Gemm(true, false, e, h, tokens, dl, e, x, h, 1, dwr, h)  // dWr += dl^T · x
	kernels.Gemm(false, false, tokens, h, e, dl, e, wr, h, 1, dx, h) // dx += dl · Wr
}

// Dispatch groups the T*k (token, slot) pairs of a Routing by expert: rows
// off[e]..off[e+1] of the row-major buffers belong to expert e, so each
// expert's feed-forward is three dense matrix products over its rows.
type Dispatch[F Float] struct {
	off   []int   // [E+1]
	tok   []int32 // [R] token of each row
	row   []int32 // [T*k] row of each (token, slot)
	xs    []F     // [R, H] inputs gathered by row
	g     []F     // [R, 2I] gate | up pre-activations
	sg    []F     // [R, I] sigmoid(gate)
	a     []F     // [R, I] silu(gate) * up
	y     []F     // [R, H] expert outputs, before the routing weight
	count []int   // [E] scratch
}

// NewDispatch allocates the dispatch of tokens tokens (hidden size h,
// intermediate size in) over e experts, k a token.
func NewDispatch[F Float](tokens, h, in, e, k int) Dispatch[F] {
	r := tokens * k
	return Dispatch[F]{off: make([]int, e+1), tok: make([]int32, r), row: make([]int32, r),
		xs: make([]F, r*h), g: make([]F, r*2*in), sg: make([]F, r*in), a: make([]F, r*in), y: make([]F, r*h),
		count: make([]int, e)}
}

// Rows is the number of (token, slot) pairs the last ExpertsForward sent
// to expert e.
func (d *Dispatch[F]) Rows(e int) int { return d.off[e+1] - d.off[e] }

// build sorts the Routing's (token, slot) pairs by expert, tokens in order.
func (d *Dispatch[F]) build(idx []int32, k int) {
	clear(d.count)
	for _, id := range idx {
		d.count[id]++
	}
	d.off[0] = 0
	for e, c := range d.count {
		d.off[e+1] = d.off[e] + c
		d.count[e] = d.off[e]
	}
	for i, id := range idx {
		r := d.count[id]
		d.count[id]++
		d.row[i] = int32(r)
		d.tok[r] = int32(i / k)
	}
}

// ExpertsForward computes out[t] = sum_j w[t,j] * FFN_{idx[t,j]}(x[t]) with
// FFN_e(v) = down[e] · (silu(gate[e]·v) * (up[e]·v)), gate_up [E, 2I, h],
// down [E, h, I].
func ExpertsForward[F Float](out, x []F, rt *Routing[F], d *Dispatch[F], gateUp, down []F, h, in int) {
	d.build(rt.Idx, rt.k)
	for r, t := range d.tok {
		copy(d.xs[r*h:(r+1)*h], x[int(t)*h:(int(t)+1)*h])
	}
	kernels.ParallelFor(len(d.off)-1, func(e int) {
		r0, r1 := d.off[e], d.off[e+1]
		n := r1 - r0
		if n == 0 {
			return
		}
		gu, dn := gateUp[e*2*in*h:(e+1)*2*in*h], down[e*h*in:(e+1)*h*in]
		xs, g, y := d.xs[r0*h:r1*h], d.g[r0*2*in:r1*2*in], d.y[r0*h:r1*h]
		sg, a := d.sg[r0*in:r1*in], d.a[r0*in:r1*in]
		kernels.Gemm(false, true, n, 2*in, h, xs, h, gu, h, 0, g, 2*in)
		siluGate(a, sg, g, n, in)
		kernels.Gemm(false, true, n, h, in, a, in, dn, in, 0, y, h)
	})
	k := rt.k
	for t := range len(d.row) / k {
		ot := out[t*h : (t+1)*h]
		clear(ot)
		for j := range k {
			wt, r := rt.W[t*k+j], int(d.row[t*k+j])
			for i, v := range d.y[r*h : (r+1)*h] {
				ot[i] += v * wt
			}
		}
	}
}

// siluGate computes, for the n rows of g [n, 2I] (gate | up), sg =
// sigmoid(gate) and a = silu(gate) * up, both [n, I].
func siluGate[F Float](a, sg, g []F, n, in int) {
	if s32, ok := any(sg).([]float32); ok {
		g32, a32 := any(g).([]float32), any(a).([]float32)
		for r := range n {
			gr, sr, ar := g32[r*2*in:(r+1)*2*in], s32[r*in:(r+1)*in], a32[r*in:(r+1)*in]
			for i := range sr {
				sr[i] = -gr[i]
			}
			kernels.ExpShift(sr, sr, 0)
			for i := range sr {
				sr[i] = 1 / (1 + sr[i])
				ar[i] = gr[i] * sr[i] * gr[in+i]
			}
		}
		return
	}
	for r := range n {
		gr, sr, ar := g[r*2*in:(r+1)*2*in], sg[r*in:(r+1)*in], a[r*in:(r+1)*in]
		for i := range ar {
			sr[i] = F(1 / (1 + math.Exp(-float64(gr[i]))))
			ar[i] = gr[i] * sr[i] * gr[in+i]
		}
	}
}

// ExpertScratch is backward's working memory for one layer's experts.
type ExpertScratch[F Float] struct {
	dy, dg, dxs []F
}

// NewExpertScratch allocates ExpertsBackward's working memory.
func NewExpertScratch[F Float](tokens, h, in, k int) ExpertScratch[F] {
	r := tokens * k
	return ExpertScratch[F]{dy: make([]F, r*h), dg: make([]F, r*2*in), dxs: make([]F, r*h)}
}

// ExpertsBackward computes, from dout [T, h], the gradients of the routing
// weights into dw [T, k] and of the expert weights into dGateUp and dDown
// (overwritten; zero for experts without tokens), and adds the input's
// gradient to dx. It reads gateUp and down and never again once it returns,
// so the caller may update the expert weights at once.
func ExpertsBackward[F Float](dx, dw, dGateUp, dDown []F, s *ExpertScratch[F], dout []F, rt *Routing[F], d *Dispatch[F], gateUp, down []F, h, in int) {
	k := rt.k
	for i, rr := range d.row {
		r, t := int(rr), i/k
		var dot F
		wt := rt.W[i]
		dyr, yr, dt := s.dy[r*h:(r+1)*h], d.y[r*h:(r+1)*h], dout[t*h:(t+1)*h]
		for j, v := range dt {
			dyr[j] = wt * v
			dot += v * yr[j]
		}
		dw[i] = dot
	}
	kernels.ParallelFor(len(d.off)-1, func(e int) {
		r0, r1 := d.off[e], d.off[e+1]
		n := r1 - r0
		gu, dn := gateUp[e*2*in*h:(e+1)*2*in*h], down[e*h*in:(e+1)*h*in]
		dgu, ddn := dGateUp[e*2*in*h:(e+1)*2*in*h], dDown[e*h*in:(e+1)*h*in]
		if n == 0 {
			clear(dgu)
			clear(ddn)
			return
		}
		xs, g, sgm, a := d.xs[r0*h:r1*h], d.g[r0*2*in:r1*2*in], d.sg[r0*in:r1*in], d.a[r0*in:r1*in]
		dy, dg, dxs := s.dy[r0*h:r1*h], s.dg[r0*2*in:r1*2*in], s.dxs[r0*h:r1*h]
		kernels.Gemm(true, false, h, in, n, dy, h, a, in, 0, ddn, in)         // dDown = dy^T · a
		kernels.Gemm(false, false, n, in, h, dy, h, dn, in, 0, dg[in:], 2*in) // dA = dy · down (in the up half)
		for r := range n {
			gr, sr, dgr := g[r*2*in:(r+1)*2*in], sgm[r*in:(r+1)*in], dg[r*2*in:(r+1)*2*in]
			for i := range in {
				gate, up, da, sg := gr[i], gr[in+i], dgr[in+i], sr[i]
				dgr[i] = da * up * sg * (1 + gate*(1-sg)) // silu'(gate)
				dgr[in+i] = da * gate * sg                // silu(gate)
			}
		}
		kernels.Gemm(true, false, 2*in, h, n, dg, 2*in, xs, h, 0, dgu, h)  // dGateUp = dg^T · xs
		kernels.Gemm(false, false, n, h, 2*in, dg, 2*in, gu, h, 0, dxs, h) // dxs = dg · gate_up
	})
	for i, rr := range d.row {
		r, t := int(rr), i/k
		dt := dx[t*h : (t+1)*h]
		for j, v := range s.dxs[r*h : (r+1)*h] {
			dt[j] += v
		}
	}
}
