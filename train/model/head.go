package model

import (
	"math"

	"github.com/sonar-moe/sonar/train/kernels"
)

// headForward computes logits [T, V] = x [T, h] · head^T (head [V, h]).
func headForward(logits, x, head []float32, h, v int) {
	kernels.Gemm(false, true, len(x)/h, v, h, x, h, head, h, 0, logits, v)
}

// headBackward adds the gradients of headForward to dx and dHead.
func headBackward(dx, dHead, dlogits, x, head []float32, h, v int) {
	tokens := len(x) / h
	kernels.Gemm(true, false, v, h, tokens, dlogits, v, x, h, 1, dHead, h)  // dHead += dl^T · x
	kernels.Gemm(false, false, tokens, h, v, dlogits, v, head, h, 1, dx, h) // dx += dl · head
}

// crossEntropy returns the mean over rows of -log softmax(logits[t])[target[t]]
// and overwrites logits [T, V] with the loss's gradient, (softmax - onehot)/T.
// Sums are taken in float64.
func crossEntropy(logits []float32, targets []int32, v int) float64 {
	tokens := len(targets)
	var total float64
	scale := 1 / float64(tokens)
	for t, y := range targets {
		lg := logits[t*v : (t+1)*v]
		mx := lg[0]
		for _, z := range lg {
			mx = max(mx, z)
		}
		var sum float64
		for _, z := range lg {
			sum += math.Exp(float64(z - mx))
		}
		lse := float64(mx) + math.Log(sum)
		total += lse - float64(lg[y])
		for j, z := range lg {
			d := math.Exp(float64(z) - lse)
			if j == int(y) {
				d--
			}
			lg[j] = float32(d * scale)
		}
	}
	return total * scale
}
