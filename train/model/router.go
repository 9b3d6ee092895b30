package model

import "math"

// routing is the router's decision for T tokens: softmax probabilities over
// the E experts, the top-k experts of each token (highest probability first,
// ties to the lower index) and their weights, the chosen probabilities
// renormalized to sum to one (as OLMoE's norm_topk_prob).
type routing struct {
	e, k   int
	logits []float32 // [T, E]; backward reuses it for the logits' gradient
	probs  []float32 // [T, E]
	idx    []int32   // [T, k]
	w      []float32 // [T, k]
}

func newRouting(tokens, e, k int) routing {
	return routing{e: e, k: k, logits: make([]float32, tokens*e), probs: make([]float32, tokens*e),
		idx: make([]int32, tokens*k), w: make([]float32, tokens*k)}
}

// routerForward routes the rows of x [T, h] with router weights wr [E, h].
func routerForward(rt *routing, x, wr []float32, h int) {
	e, k := rt.e, rt.k
	tokens := len(rt.idx) / k
	gemm(false, true, tokens, e, h, x, h, wr, h, 0, rt.logits, e)
	for t := range tokens {
		lg, p := rt.logits[t*e:(t+1)*e], rt.probs[t*e:(t+1)*e]
		mx := lg[0]
		for _, v := range lg {
			mx = max(mx, v)
		}
		var sum float64
		for j, v := range lg {
			ex := math.Exp(float64(v - mx))
			p[j] = float32(ex)
			sum += ex
		}
		inv := float32(1 / sum)
		for j := range p {
			p[j] *= inv
		}
		idx, w := rt.idx[t*k:(t+1)*k], rt.w[t*k:(t+1)*k]
		topK(idx, p)
		var s float32
		for j, id := range idx {
			w[j] = p[id]
			s += w[j]
		}
		for j := range w {
			w[j] /= s
		}
	}
}

// topK writes the indices of the len(idx) largest values of p into idx,
// largest first; equal values keep index order.
func topK(idx []int32, p []float32) {
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

// routerBackward takes the gradient of the renormalized weights dw [T, k]
// back through the top-k renormalization and the softmax, and adds the
// gradients of the router's input to dx [T, h] and of its weights to dwr.
// The top-k choice itself is piecewise constant and has no gradient.
func routerBackward(dx, dwr []float32, rt *routing, dw, x, wr []float32, h int) {
	e, k := rt.e, rt.k
	tokens := len(rt.idx) / k
	dl := rt.logits // the logits are not needed any more
	for t := range tokens {
		p, d := rt.probs[t*e:(t+1)*e], dl[t*e:(t+1)*e]
		idx, w, dwt := rt.idx[t*k:(t+1)*k], rt.w[t*k:(t+1)*k], dw[t*k:(t+1)*k]
		// w_j = p_j / S, S = sum of the chosen p: dp_m = (dw_m - sum_j dw_j w_j) / S.
		var s, dot float32
		for j, id := range idx {
			s += p[id]
			dot += dwt[j] * w[j]
		}
		clear(d)
		for j, id := range idx {
			d[id] = (dwt[j] - dot) / s // dp for now
		}
		// Softmax: dlogit_i = p_i (dp_i - sum_m dp_m p_m).
		var pd float32
		for _, id := range idx {
			pd += d[id] * p[id]
		}
		for i := range d {
			d[i] = p[i] * (d[i] - pd)
		}
	}
	gemm(true, false, e, h, tokens, dl, e, x, h, 1, dwr, h)  // dWr += dl^T · x
	gemm(false, false, tokens, h, e, dl, e, wr, h, 1, dx, h) // dx += dl · Wr
}
