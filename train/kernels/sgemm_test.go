package kernels

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// The kernel path against a float64 reference on shapes with ragged edges
// (not multiples of 6, 16, the block sizes), all transposes, strided
// leading dimensions and beta 0, 1 and another value.
func TestSgemmKernel(t *testing.T) {
	if !useKernel {
		t.Skip("no AVX2+FMA")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, sh := range [][3]int{{1, 1, 1}, {7, 17, 5}, {6, 16, 256}, {40, 1030, 260}, {80, 33, 513}, {13, 40, 1}} {
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				for _, beta := range []float32{0, 1, -0.5} {
					m, n, k := sh[0], sh[1], sh[2]
					t.Run(fmt.Sprintf("%dx%dx%d_ta%v_tb%v_beta%v", m, n, k, ta, tb, beta), func(t *testing.T) {
						ar, ac := m, k
						if ta {
							ar, ac = k, m
						}
						br, bc := k, n
						if tb {
							br, bc = n, k
						}
						lda, ldb, ldc := ac+3, bc+1, n+2
						a, b, c := make([]float32, ar*lda), make([]float32, br*ldb), make([]float32, m*ldc)
						for _, x := range [][]float32{a, b, c} {
							for i := range x {
								x[i] = float32(rng.NormFloat64())
							}
						}
						want := make([]float64, m*n)
						for i := range m {
							for j := range n {
								var s float64
								for p := range k {
									ai, bi := i*lda+p, p*ldb+j
									if ta {
										ai = p*lda + i
									}
									if tb {
										bi = j*ldb + p
									}
									av, bv := a[ai], b[bi]
									s += float64(av) * float64(bv)
								}
								want[i*n+j] = s + float64(beta)*float64(c[i*ldc+j])
							}
						}
						pad := c[ldc-1]
						sgemmKernel(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc)
						for i := range m {
							for j := range n {
								if d := math.Abs(float64(c[i*ldc+j]) - want[i*n+j]); d > 1e-4*math.Sqrt(float64(k)) {
									t.Fatalf("C[%d,%d] = %v, want %v", i, j, c[i*ldc+j], want[i*n+j])
								}
							}
						}
						if c[ldc-1] != pad {
							t.Fatalf("wrote past the row into the leading-dimension padding")
						}
					})
				}
			}
		}
	}
}
