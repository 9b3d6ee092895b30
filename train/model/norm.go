package model

import "math"

// rmsNormForward computes, for each row t of x [T, h],
// y[t] = x[t] * r[t] * g with r[t] = 1/sqrt(mean(x[t]^2) + eps), and keeps r.
func rmsNormForward(y, r, x, g []float32, h int, eps float32) {
	for t := range r {
		xt, yt := x[t*h:(t+1)*h], y[t*h:(t+1)*h]
		var ss float64
		for _, v := range xt {
			ss += float64(v) * float64(v)
		}
		rt := float32(1 / math.Sqrt(ss/float64(h)+float64(eps)))
		r[t] = rt
		for j, v := range xt {
			yt[j] = v * rt * g[j]
		}
	}
}

// rmsNormBackward adds the gradients of rmsNormForward to dx and dg:
// with u = dy*g, dx += r*u - x * r^3 * sum(u*x)/h and dg += dy*x*r.
func rmsNormBackward(dx, dg, dy, x, g, r []float32, h int) {
	for t, rt := range r {
		xt, dyt, dxt := x[t*h:(t+1)*h], dy[t*h:(t+1)*h], dx[t*h:(t+1)*h]
		var dot float64
		for j, v := range xt {
			u := dyt[j] * g[j]
			dot += float64(u) * float64(v)
			dg[j] += dyt[j] * v * rt
		}
		c := float32(dot / float64(h) * float64(rt) * float64(rt) * float64(rt))
		for j, v := range xt {
			dxt[j] += rt*dyt[j]*g[j] - c*v
		}
	}
}
