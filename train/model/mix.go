package model

import (
	"github.com/sonar-moe/sonar/train/kernels"
)

// The mixing layer is the model's only path between positions: a causal
// depthwise convolution over the last K tokens of the same sequence followed
// by a dense projection, u[b,t] = sum_{j<K, j<=t} c[j] * n[b,t-j] and
// y = u · Wo^T. It is far cheaper than attention and enough for a byte-level
// model to learn local structure (words, indentation, keywords).

// mixForward fills u and y ([batch*seq, h]) from n with conv c [k, h] and
// projection wo [h, h].
func mixForward(y, u, n, c, wo []float32, batch, seq, h, k int) {
	clear(u)
	for b := range batch {
		for t := range seq {
			ut := u[(b*seq+t)*h : (b*seq+t+1)*h]
			for j := 0; j < k && j <= t; j++ {
				cj, src := c[j*h:(j+1)*h], n[(b*seq+t-j)*h:(b*seq+t-j+1)*h]
				for i := range ut {
					ut[i] += cj[i] * src[i]
				}
			}
		}
	}
	kernels.Gemm(false, true, batch*seq, h, h, u, h, wo, h, 0, y, h)
}

// mixBackward adds to dn, dc and dwo the gradients of mixForward given dy;
// du ([batch*seq, h]) is scratch.
func mixBackward(dn, dc, dwo, du, dy, n, u, c, wo []float32, batch, seq, h, k int) {
	rows := batch * seq
	kernels.Gemm(true, false, h, h, rows, dy, h, u, h, 1, dwo, h)  // dWo += dy^T · u
	kernels.Gemm(false, false, rows, h, h, dy, h, wo, h, 0, du, h) // du = dy · Wo
	for b := range batch {
		for t := range seq {
			dut := du[(b*seq+t)*h : (b*seq+t+1)*h]
			for j := 0; j < k && j <= t; j++ {
				o := (b*seq + t - j) * h
				cj, dcj := c[j*h:(j+1)*h], dc[j*h:(j+1)*h]
				src, dsrc := n[o:o+h], dn[o:o+h]
				for i, g := range dut {
					dcj[i] += g * src[i]
					dsrc[i] += g * cj[i]
				}
			}
		}
	}
}
