package hfmoe

import (
	"math"

	"github.com/sonar-moe/sonar/train/kernels"
)

// ropeTables returns cos and sin [seq, d] of the default rotary embedding,
// computed in float32 as OlmoeRotaryEmbedding does: inv_freq[i] =
// 1/theta^(2i/d), angle = pos * inv_freq, the d/2 angles repeated twice.
func ropeTables[F Float](seq, d int, theta float64) (cos, sin []F) {
	cos, sin = make([]F, seq*d), make([]F, seq*d)
	half := d / 2
	for i := range half {
		ex := float32(2*i) / float32(d)
		inv := 1 / float32(math.Pow(theta, float64(ex)))
		for s := range seq {
			a := float32(s) * inv
			c, sn := F(float32(math.Cos(float64(a)))), F(float32(math.Sin(float64(a))))
			cos[s*d+i], cos[s*d+half+i] = c, c
			sin[s*d+i], sin[s*d+half+i] = sn, sn
		}
	}
	return cos, sin
}

// ropeForward rotates, in place, every head of width d of x [T, w] (T =
// batch*seq, position t % seq): x*cos + rotate_half(x)*sin, rotate_half(x)
// = [-x2, x1].
func ropeForward[F Float](x, cos, sin []F, seq, w, d int) {
	half := d / 2
	for t := range len(x) / w {
		s := t % seq
		c, sn := cos[s*d:(s+1)*d], sin[s*d:(s+1)*d]
		for h0 := 0; h0 < w; h0 += d {
			v := x[t*w+h0 : t*w+h0+d]
			for i := range half {
				a, b := v[i], v[half+i]
				v[i] = a*c[i] - b*sn[i]
				v[half+i] = b*c[half+i] + a*sn[half+i]
			}
		}
	}
}

// ropeBackward takes the gradient of ropeForward back, in place (the
// rotation's transpose).
func ropeBackward[F Float](dx, cos, sin []F, seq, w, d int) {
	half := d / 2
	for t := range len(dx) / w {
		s := t % seq
		c, sn := cos[s*d:(s+1)*d], sin[s*d:(s+1)*d]
		for h0 := 0; h0 < w; h0 += d {
			v := dx[t*w+h0 : t*w+h0+d]
			for i := range half {
				a, b := v[i], v[half+i]
				v[i] = a*c[i] + b*sn[half+i]
				v[half+i] = b*c[half+i] - a*sn[i]
			}
		}
	}
}

// attnShape is the shape of causal self-attention over batch sequences.
type attnShape struct {
	batch, seq, heads, kvHeads, d int
	scale                         float64
}

// attentionForward computes, for every sequence and head, o = softmax(q k^T
// * scale + causal mask) v, keeping the probabilities in p [B, heads, S, S].
// q and o are [T, heads*d], k and v [T, kvHeads*d]; head h reads key/value
// head h / (heads/kvHeads).
func attentionForward[F Float](o, p, q, k, v []F, a attnShape) {
	s, d := a.seq, a.d
	hw, kw := a.heads*d, a.kvHeads*d
	group := a.heads / a.kvHeads
	kernels.ParallelFor(a.batch*a.heads, func(i int) {
		b, h := i/a.heads, i%a.heads
		g := h / group
		pb := p[i*s*s : (i+1)*s*s]
		qb := q[b*s*hw+h*d:]
		kb := k[b*s*kw+g*d:]
		vb := v[b*s*kw+g*d:]
		kernels.Gemm(false, true, s, s, d, qb, hw, kb, kw, 0, pb, s)
		causalSoftmax(pb, s, a.scale)
		kernels.Gemm(false, false, s, d, s, pb, s, vb, kw, 0, o[b*s*hw+h*d:], hw)
	})
}

// attentionBackward takes do [T, heads*d] back through attentionForward:
// dq is overwritten, dk and dv (zeroed by the caller) accumulate over the
// heads of each group. dp is scratch of p's size.
func attentionBackward[F Float](dq, dk, dv, dp, do, p, q, k, v []F, a attnShape) {
	s, d := a.seq, a.d
	hw, kw := a.heads*d, a.kvHeads*d
	group := a.heads / a.kvHeads
	// One task per (sequence, key/value head): the heads of a group add into
	// the same dk and dv, one after the other.
	kernels.ParallelFor(a.batch*a.kvHeads, func(i int) {
		b, g := i/a.kvHeads, i%a.kvHeads
		kb, vb := k[b*s*kw+g*d:], v[b*s*kw+g*d:]
		dkb, dvb := dk[b*s*kw+g*d:], dv[b*s*kw+g*d:]
		for h := g * group; h < (g+1)*group; h++ {
			j := b*a.heads + h
			pb, dpb := p[j*s*s:(j+1)*s*s], dp[j*s*s:(j+1)*s*s]
			dob, qb, dqb := do[b*s*hw+h*d:], q[b*s*hw+h*d:], dq[b*s*hw+h*d:]
			kernels.Gemm(true, false, s, d, s, pb, s, dob, hw, 1, dvb, kw) // dv += p^T do
			kernels.Gemm(false, true, s, s, d, dob, hw, vb, kw, 0, dpb, s) // dp = do v^T
			for r := range s {
				pr, dr := pb[r*s:(r+1)*s], dpb[r*s:(r+1)*s]
				var dot float64
				for c := 0; c <= r; c++ {
					dot += float64(pr[c]) * float64(dr[c])
				}
				for c := 0; c <= r; c++ {
					dr[c] = F(float64(pr[c]) * (float64(dr[c]) - dot) * a.scale)
				}
				clear(dr[r+1:])
			}
			kernels.Gemm(false, false, s, d, s, dpb, s, kb, kw, 0, dqb, hw) // dq = ds k
			kernels.Gemm(true, false, s, d, s, dpb, s, qb, hw, 1, dkb, kw)  // dk += ds^T q
		}
	})
}

// causalSoftmax turns the scores p [s, s] of one head into probabilities:
// row r is softmax(p[r, 0..r] * scale), zero past column r.
func causalSoftmax[F Float](p []F, s int, scale float64) {
	if p32, ok := any(p).([]float32); ok {
		sc := float32(scale)
		for r := range s {
			row := p32[r*s : r*s+r+1]
			mx := float32(math.Inf(-1))
			for j := range row {
				row[j] *= sc
				mx = max(mx, row[j])
			}
			kernels.ExpShift(row, row, mx)
			normalize(row)
			clear(p32[r*s+r+1 : (r+1)*s])
		}
		return
	}
	for r := range s {
		row := p[r*s : (r+1)*s]
		mx := math.Inf(-1)
		for j := 0; j <= r; j++ {
			row[j] *= F(scale)
			mx = max(mx, float64(row[j]))
		}
		var sum float64
		for j := 0; j <= r; j++ {
			e := math.Exp(float64(row[j]) - mx)
			row[j] = F(e)
			sum += e
		}
		inv := 1 / sum
		for j := 0; j <= r; j++ {
			row[j] = F(float64(row[j]) * inv)
		}
		clear(row[r+1:])
	}
}

// normalize divides x by its sum (taken in float64).
func normalize(x []float32) {
	var sum float64
	for _, v := range x {
		sum += float64(v)
	}
	inv := 1 / sum
	for j, v := range x {
		x[j] = float32(float64(v) * inv)
	}
}

// crossEntropy returns the mean cross-entropy of logits [T, v] against
// targets (negative: ignored, as labels of -100 in transformers), the number
// of counted rows, and keeps each row's log-sum-exp in lse.
func crossEntropy[F Float](logits []F, lse []float64, targets []int32, v int) (float64, int) {
	var sum float64
	n := 0
	l32, fast := any(logits).([]float32)
	var buf []float32
	if fast {
		buf = make([]float32, v)
	}
	for t, y := range targets {
		row := logits[t*v : (t+1)*v]
		mx := math.Inf(-1)
		for _, x := range row {
			mx = max(mx, float64(x))
		}
		var s float64
		if fast {
			kernels.ExpShift(buf, l32[t*v:(t+1)*v], float32(mx))
			for _, e := range buf {
				s += float64(e)
			}
		} else {
			for _, x := range row {
				s += math.Exp(float64(x) - mx)
			}
		}
		lse[t] = mx + math.Log(s)
		if y >= 0 {
			sum += lse[t] - float64(row[y])
			n++
		}
	}
	if n == 0 {
		return 0, 0
	}
	return sum / float64(n), n
}

// crossEntropyBackward turns logits into the gradient of the mean
// cross-entropy times scale (in place): (softmax - onehot) * scale / n on
// counted rows, zero on ignored ones.
func crossEntropyBackward[F Float](logits []F, lse []float64, targets []int32, v, n int, scale float64) {
	f := scale / float64(max(n, 1))
	l32, fast := any(logits).([]float32)
	for t, y := range targets {
		row := logits[t*v : (t+1)*v]
		if y < 0 {
			clear(row)
			continue
		}
		if fast {
			r32 := l32[t*v : (t+1)*v]
			kernels.ExpShift(r32, r32, float32(lse[t]))
			for j, e := range r32 {
				r32[j] = float32(float64(e) * f)
			}
		} else {
			for j, x := range row {
				row[j] = F(math.Exp(float64(x)-lse[t]) * f)
			}
		}
		row[y] -= F(f)
	}
}
