// Package kernels is the arithmetic the Go models of Sonar-MoE share
// (train/model, the byte-level model, and train/hfmoe, OLMoE and
// GraniteMoe): the matrix product Gemm (an AVX2+FMA SGEMM, sgemm.go, with
// gonum's pure-Go BLAS as the fallback and for float64), a vector float32
// exp (ExpShift), a parallel loop over disjoint work (ParallelFor), and
// allocation at chosen offsets mod 4 KiB (AllocAt) against 4K aliasing.
// Every result here is independent of the schedule, which the trainers'
// bitwise comparison of per-layer and keep-all updates relies on.
package kernels

import (
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

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

// Gemm computes C = op(A)·op(B) + beta·C for row-major matrices with leading
// dimensions lda, ldb, ldc, where op(A) is m×k and op(B) is k×n. float32
// products go to sgemmKernel (sgemm.go) where the CPU has AVX2 and FMA and
// the product is not tiny, else to gonum's pure-Go BLAS; float64 to gonum.
// Either way results do not depend on scheduling.
func Gemm[F Float](transA, transB bool, m, n, k int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int) {
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

// ParallelFor calls fn(i) for i in [0, n) on up to GOMAXPROCS goroutines,
// each taking the next i as it finishes one. Callers use it only where the
// calls write disjoint memory, so results do not depend on the schedule.
func ParallelFor(n int, fn func(i int)) {
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

// AllocAt returns n zeroed elements whose first one sits at byte offset off
// mod 4 KiB (off a multiple of the element size). Fresh large allocations
// are page aligned; arrays that one loop reads and writes together
// (weights, gradients, the optimizer's exp_avg and exp_avg_sq) must start at
// different offsets, or their loads and stores alias in the CPU's store
// buffer ("4K aliasing"): a plain AdamW loop over four page-aligned arrays
// was measured 8-15x slower than over staggered ones on this project's
// machines.
func AllocAt[F Float](n, off int) []F {
	var z F
	size := int(unsafe.Sizeof(z))
	page := 4096 / size
	buf := make([]F, n+page)
	base := int(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%4096) / size
	start := ((off/size)%page - base + page) % page
	return buf[start : start+n : start+n]
}

// Bytes views float32s as their bytes (no copy), the form optimizer.Tensor
// takes for parameters and gradients.
func Bytes(w []float32) []byte {
	if len(w) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), 4*len(w))
}
