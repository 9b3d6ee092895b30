package kernels

import "math"

// RMSNormForward computes, per row t of x [T, h], y[t] = (x[t] * r[t]) * g
// with r[t] = 1/sqrt(mean(x[t]^2) + eps) (the mean in float64), as
// OlmoeRMSNorm, and keeps r for RMSNormBackward.
func RMSNormForward[F Float](y, r, x, g []F, h int, eps float64) {
	for t := range r {
		xt, yt := x[t*h:(t+1)*h], y[t*h:(t+1)*h]
		var ss float64
		for _, v := range xt {
			ss += float64(v) * float64(v)
		}
		rt := F(1 / math.Sqrt(ss/float64(h)+eps))
		r[t] = rt
		for j, v := range xt {
			yt[j] = v * rt * g[j]
		}
	}
}

// RMSNormBackward adds the gradients of RMSNormForward to dx and dg:
// with u = dy*g, dx += r*u - x * r^3 * sum(u*x)/h and dg += dy*x*r.
func RMSNormBackward[F Float](dx, dg, dy, x, g, r []F, h int) {
	for t, rt := range r {
		xt, dyt, dxt := x[t*h:(t+1)*h], dy[t*h:(t+1)*h], dx[t*h:(t+1)*h]
		var dot float64
		for j, v := range xt {
			u := dyt[j] * g[j]
			dot += float64(u) * float64(v)
			dg[j] += dyt[j] * v * rt
		}
		r64 := float64(rt)
		c := F(dot / float64(h) * r64 * r64 * r64)
		for j, v := range xt {
			dxt[j] += rt*dyt[j]*g[j] - c*v
		}
	}
}
