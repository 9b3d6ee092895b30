package hfmoe

import "sync"

// sgemm is the float32 matrix product of the training path where the CPU
// has AVX2 and FMA: C = op(A)·op(B) + beta·C, row-major, blocked as in the
// GotoBLAS/BLIS scheme. Blocks of kc rows of op(B) and nc columns are packed
// into panels of 16 columns, blocks of mc rows of op(A) into panels of 6
// rows, and an assembly micro-kernel (kern6x16, sgemm_amd64.s) computes each
// 6x16 tile of the block's product with one FMA chain per element. Every
// element of C is summed in a fixed order (k blocks in order, p in order
// inside a block), so results do not depend on the schedule: row blocks run
// in parallel but never share an element. gonum's pure-Go SGEMM, which this
// replaces on such CPUs, spent 85% of a training step (docs/go-trainer.md).
const (
	mr, nr     = 6, 16
	kcBlock    = 256
	mcBlock    = 72 // multiple of mr
	ncBlock    = 1024
	minKernelF = 32 * 32 * 32 // smaller products stay on gonum
)

var packPool = sync.Pool{New: func() any { return new([]float32) }}

func getBuf(n int) *[]float32 {
	p := packPool.Get().(*[]float32)
	if cap(*p) < n {
		*p = make([]float32, n)
	}
	*p = (*p)[:n]
	return p
}

func sgemmKernel(transA, transB bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if beta != 1 {
		for i := range m {
			row := c[i*ldc : i*ldc+n]
			if beta == 0 {
				clear(row)
				continue
			}
			for j := range row {
				row[j] *= beta
			}
		}
	}
	for jc := 0; jc < n; jc += ncBlock {
		nb := min(ncBlock, n-jc)
		npan := (nb + nr - 1) / nr
		for pc := 0; pc < k; pc += kcBlock {
			kb := min(kcBlock, k-pc)
			bp := getBuf(npan * nr * kb)
			packB(*bp, transB, b, ldb, pc, kb, jc, nb)
			blocks := (m + mcBlock - 1) / mcBlock
			parallelFor(blocks, func(ib int) {
				ic := ib * mcBlock
				mb := min(mcBlock, m-ic)
				mpan := (mb + mr - 1) / mr
				ap := getBuf(mpan * mr * kb)
				packA(*ap, transA, a, lda, ic, mb, pc, kb)
				var tile [mr * nr]float32
				for jp := range npan {
					bpan := (*bp)[jp*nr*kb:]
					j0 := jc + jp*nr
					nj := min(nr, jc+nb-j0)
					for ip := range mpan {
						kern6x16(kb, &(*ap)[ip*mr*kb], &bpan[0], &tile[0])
						i0 := ic + ip*mr
						for i := range min(mr, ic+mb-i0) {
							row := c[(i0+i)*ldc+j0 : (i0+i)*ldc+j0+nj]
							t := tile[i*nr : i*nr+nj]
							for j := range row {
								row[j] += t[j]
							}
						}
					}
				}
				packPool.Put(ap)
			})
			packPool.Put(bp)
		}
	}
}

// packA copies rows ic..ic+mb of op(A), columns pc..pc+kb, into panels of
// mr rows: panel ip holds, for each p, the mr values of rows ip*mr.. (zero
// past the last row). Both loops read memory contiguously.
func packA(dst []float32, trans bool, a []float32, lda, ic, mb, pc, kb int) {
	for ip := 0; ip*mr < mb; ip++ {
		pan := dst[ip*mr*kb : (ip+1)*mr*kb]
		rows := min(mr, mb-ip*mr)
		r0 := ic + ip*mr
		if rows < mr {
			clear(pan)
		}
		if trans { // op(A)[r][p] = a[p*lda+r]: row p of a holds the panel's values for p
			for p := range kb {
				copy(pan[p*mr:p*mr+rows], a[(pc+p)*lda+r0:(pc+p)*lda+r0+rows])
			}
			continue
		}
		for i := range rows {
			src := a[(r0+i)*lda+pc : (r0+i)*lda+pc+kb]
			for p, v := range src {
				pan[p*mr+i] = v
			}
		}
	}
}

// packB copies rows pc..pc+kb of op(B), columns jc..jc+nb, into panels of
// nr columns: panel jp holds, for each p, the nr values of columns jp*nr..
// (zero past the last column).
func packB(dst []float32, trans bool, b []float32, ldb, pc, kb, jc, nb int) {
	for jp := 0; jp*nr < nb; jp++ {
		pan := dst[jp*nr*kb : (jp+1)*nr*kb]
		cols := min(nr, nb-jp*nr)
		j0 := jc + jp*nr
		if cols < nr {
			clear(pan)
		}
		if trans { // op(B)[p][j] = b[j*ldb+p]: row j of b holds column j for every p
			for j := range cols {
				src := b[(j0+j)*ldb+pc : (j0+j)*ldb+pc+kb]
				for p, v := range src {
					pan[p*nr+j] = v
				}
			}
			continue
		}
		for p := range kb {
			copy(pan[p*nr:p*nr+cols], b[(pc+p)*ldb+j0:(pc+p)*ldb+j0+cols])
		}
	}
}
