package model

import "math"

// dispatch groups the T*k (token, slot) pairs of a routing by expert: rows
// off[e]..off[e+1] of the row-major buffers belong to expert e, so each
// expert's feed-forward is three dense matrix products over its rows.
type dispatch struct {
	off   []int     // [E+1]
	tok   []int32   // [R] token of each row
	row   []int32   // [T*k] row of each (token, slot)
	xs    []float32 // [R, H] inputs gathered by row
	g     []float32 // [R, 2I] gate | up pre-activations
	sg    []float32 // [R, I] sigmoid(gate), kept for backward
	a     []float32 // [R, I] silu(gate) * up
	y     []float32 // [R, H] expert outputs, before the routing weight
	count []int     // [E] scratch
}

func newDispatch(tokens, h, in, e, k int) dispatch {
	r := tokens * k
	return dispatch{off: make([]int, e+1), tok: make([]int32, r), row: make([]int32, r),
		xs: make([]float32, r*h), g: make([]float32, r*2*in), sg: make([]float32, r*in), a: make([]float32, r*in), y: make([]float32, r*h),
		count: make([]int, e)}
}

// build sorts the routing's (token, slot) pairs by expert, tokens in order.
func (d *dispatch) build(rt *routing) {
	clear(d.count)
	for _, id := range rt.idx {
		d.count[id]++
	}
	d.off[0] = 0
	for e, c := range d.count {
		d.off[e+1] = d.off[e] + c
		d.count[e] = d.off[e] // next free row of e
	}
	for i, id := range rt.idx {
		r := d.count[id]
		d.count[id]++
		d.row[i] = int32(r)
		d.tok[r] = int32(i / rt.k)
	}
}

func sigmoid(x float32) float32 { return float32(1 / (1 + math.Exp(-float64(x)))) }

// expertsForward runs the batched SiLU-gated experts on the rows of x
// [T, h] as routed: out[t] = sum_j w[t,j] * FFN_{idx[t,j]}(x[t]) with
// FFN_e(v) = down[e] · (silu(gate[e]·v) * (up[e]·v)), gate_up [E, 2I, h],
// down [E, h, I].
func expertsForward(out, x []float32, rt *routing, d *dispatch, gateUp, down []float32, h, in int) {
	d.build(rt)
	for r, t := range d.tok {
		copy(d.xs[r*h:(r+1)*h], x[int(t)*h:(int(t)+1)*h])
	}
	e := len(d.off) - 1
	parallelFor(e, func(e int) {
		r0, r1 := d.off[e], d.off[e+1]
		n := r1 - r0
		if n == 0 {
			return
		}
		gu, dn := gateUp[e*2*in*h:(e+1)*2*in*h], down[e*h*in:(e+1)*h*in]
		xs, g, y := d.xs[r0*h:r1*h], d.g[r0*2*in:r1*2*in], d.y[r0*h:r1*h]
		sg, a := d.sg[r0*in:r1*in], d.a[r0*in:r1*in]
		gemm(false, true, n, 2*in, h, xs, h, gu, h, 0, g, 2*in) // g = xs · gu^T
		for r := range n {
			gr, sr, ar := g[r*2*in:(r+1)*2*in], sg[r*in:(r+1)*in], a[r*in:(r+1)*in]
			for i := range ar {
				gate := gr[i]
				sr[i] = sigmoid(gate)
				ar[i] = gate * sr[i] * gr[in+i]
			}
		}
		gemm(false, true, n, h, in, a, in, dn, in, 0, y, h) // y = a · down^T
	})
	combine(out, d.y, rt.w, d.row, h, rt.k)
}

// combine sets out[t] = sum_j w[t,j] * y[row[t,j]], slots in order.
func combine(out, y, w []float32, row []int32, h, k int) {
	for t := range len(row) / k {
		ot := out[t*h : (t+1)*h]
		clear(ot)
		for j := range k {
			wt, r := w[t*k+j], int(row[t*k+j])
			for i, v := range y[r*h : (r+1)*h] {
				ot[i] += wt * v
			}
		}
	}
}

// expertScratch is backward's working memory for one layer's experts.
type expertScratch struct {
	dy  []float32 // [R, H] gradient of each row's output
	dg  []float32 // [R, 2I] gradient of gate | up (first holds dA in its up half)
	dxs []float32 // [R, H] gradient of each row's input
}

func newExpertScratch(tokens, h, in, k int) expertScratch {
	r := tokens * k
	return expertScratch{dy: make([]float32, r*h), dg: make([]float32, r*2*in), dxs: make([]float32, r*h)}
}

// expertsBackward computes, from dout [T, h]: the gradients of the routing
// weights into dw [T, k] (overwritten), of the expert weights into dGateUp
// and dDown (overwritten, zero for experts that got no token) and adds the
// gradient of the input to dx [T, h]. It reads gateUp and down and never
// touches them or the gradients again once it returns, so the caller may
// update the expert weights at once.
func expertsBackward(dx, dw, dGateUp, dDown []float32, s *expertScratch, dout []float32, rt *routing, d *dispatch, gateUp, down []float32, h, in int) {
	k := rt.k
	// Per row: dy = w * dout[t]; dw[t,j] = dout[t] · y[row].
	for i, rr := range d.row {
		r, t := int(rr), i/k
		dot := float32(0)
		wt := rt.w[i]
		dyr, yr, dt := s.dy[r*h:(r+1)*h], d.y[r*h:(r+1)*h], dout[t*h:(t+1)*h]
		for j, v := range dt {
			dyr[j] = wt * v
			dot += v * yr[j]
		}
		dw[i] = dot
	}
	e := len(d.off) - 1
	parallelFor(e, func(e int) {
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
		gemm(true, false, h, in, n, dy, h, a, in, 0, ddn, in)         // dDown = dy^T · a
		gemm(false, false, n, in, h, dy, h, dn, in, 0, dg[in:], 2*in) // dA = dy · down (in the up half)
		for r := range n {
			gr, sr, dgr := g[r*2*in:(r+1)*2*in], sgm[r*in:(r+1)*in], dg[r*2*in:(r+1)*2*in]
			for i := range in {
				gate, up, da, sg := gr[i], gr[in+i], dgr[in+i], sr[i]
				dgr[i] = da * up * sg * (1 + gate*(1-sg)) // silu'(gate)
				dgr[in+i] = da * gate * sg                // silu(gate)
			}
		}
		gemm(true, false, 2*in, h, n, dg, 2*in, xs, h, 0, dgu, h)  // dGateUp = dg^T · xs
		gemm(false, false, n, h, 2*in, dg, 2*in, gu, h, 0, dxs, h) // dxs = dg · gate_up
	})
	for i, rr := range d.row {
		r, t := int(rr), i/k
		dt := dx[t*h : (t+1)*h]
		for j, v := range s.dxs[r*h : (r+1)*h] {
			dt[j] += v
		}
	}
}
