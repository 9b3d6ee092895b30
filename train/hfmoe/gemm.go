package hfmoe

import (
	"runtime"
	"sync"
	"sync/atomic"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"
	"gonum.org/v1/gonum/blas/blas64"
)

// Float is the element type of a model: float32 to train, float64 for
// finite-difference gradient checks.
type Float interface{ float32 | float64 }

var (
	sgemm = blas32.Implementation()
	dgemm = blas64.Implementation()
)

// gemm computes C = op(A)·op(B) + beta·C for row-major matrices with leading
// dimensions lda, ldb, ldc, where op(A) is m×k and op(B) is k×n. float32
// products go to sgemmKernel (sgemm.go) where the CPU has AVX2 and FMA and
// the product is not tiny, else to gonum's pure-Go BLAS; float64 to gonum.
// Either way results do not depend on scheduling.
func gemm[F Float](transA, transB bool, m, n, k int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		for i := range m {
			row := c[i*ldc : i*ldc+n]
			for j := range row {
				row[j] *= beta
			}
		}
		return
	}
	ta, tb := blas.NoTrans, blas.NoTrans
	if transA {
		ta = blas.Trans
	}
	if transB {
		tb = blas.Trans
	}
	switch a := any(a).(type) {
	case []float32:
		if useKernel && m*n*k >= minKernelF {
			sgemmKernel(transA, transB, m, n, k, a, lda, any(b).([]float32), ldb, float32(beta), any(c).([]float32), ldc)
			return
		}
		sgemm.Sgemm(ta, tb, m, n, k, 1, a, lda, any(b).([]float32), ldb, float32(beta), any(c).([]float32), ldc)
	case []float64:
		dgemm.Dgemm(ta, tb, m, n, k, 1, a, lda, any(b).([]float64), ldb, float64(beta), any(c).([]float64), ldc)
	}
}

// parallelFor calls fn(i) for i in [0, n) on up to GOMAXPROCS goroutines.
// Callers use it only where the calls write disjoint memory, so results do
// not depend on the schedule.
func parallelFor(n int, fn func(i int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				fn(i)
			}
		}()
	}
	wg.Wait()
}
