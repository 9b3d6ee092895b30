package model

import (
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"
)

// Matrix products use gonum's BLAS (gonum.org/v1/gonum/blas/gonum through
// blas32): pure Go, no cgo BLAS to install, well maintained, and its SGEMM
// splits large products across cores (about 15 GFLOP/s at 512^3 on two
// cores). Results do not depend on scheduling: each block of C is summed
// along k in a fixed order.
var sgemm = blas32.Implementation()

// gemm computes C = op(A)·op(B) + beta·C for row-major matrices, where
// op(A) is m×k and op(B) is k×n; transA/transB select the transposes.
func gemm(transA, transB bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
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
	sgemm.Sgemm(ta, tb, m, n, k, 1, a, lda, b, ldb, beta, c, ldc)
}

// parallelFor calls fn(i) for i in [0, n) on up to GOMAXPROCS goroutines.
// Callers only use it where the calls write disjoint memory, so results do
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

func addr32(b []float32) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// Bytes views float32s as their bytes (no copy), the form optimizer.Tensor
// takes for parameters and gradients.
func Bytes(w []float32) []byte {
	if len(w) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), 4*len(w))
}
