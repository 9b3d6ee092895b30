package kernels

import "sync"

// sgemm is the float32 matrix product of the training path where the CPU
// has AVX2 and FMA: C = op(A)·op(B) + beta·C, row-major, blocked as in the
// GotoBLAS/BLIS scheme. Blocks of kc rows of op(B) and nc columns are split
// into panels of 16 columns, blocks of mc rows of op(A) into panels of 6
// rows, and an assembly micro-kernel (kern6x16, sgemm_amd64.s) computes each
// 6x16 tile of the block's product with one FMA chain per element, added
// to C in place (or stored, for beta 0). Full panels are read where they are
// (the kernel takes strides): only a transposed op(B) and partial panels are
// packed (packing every panel had cost a fifth of a training step). Every
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
	if beta != 1 && beta != 0 { // beta 0: the first k block stores its sums
		for i := range m {
			row := c[i*ldc : i*ldc+n]
			for j := range row {
				row[j] *= beta
			}
		}
	}
	// op(A)[i][p] sits at a[i*ars + p*aps]: full panels of 6 rows are read
	// in place, only a last, partial one is packed (with zero rows). op(B)
	// is read in place too when it is not transposed, but a partial last
	// panel; a transposed one is packed.
	ars, aps := lda, 1
	if transA {
		ars, aps = 1, lda
	}
	for jc := 0; jc < n; jc += ncBlock {
		nb := min(ncBlock, n-jc)
		npan := (nb + nr - 1) / nr
		for pc := 0; pc < k; pc += kcBlock {
			kb := min(kcBlock, k-pc)
			acc := beta != 0 || pc > 0
			var bp *[]float32
			if transB {
				bp = getBuf(npan * nr * kb)
				packB(*bp, true, b, ldb, pc, kb, jc, nb)
			} else if nb%nr != 0 {
				bp = getBuf(npan * nr * kb) // only the last panel is packed
				packB((*bp)[(npan-1)*nr*kb:], false, b, ldb, pc, kb, jc+(npan-1)*nr, nb%nr)
			}
			blocks := (m + mcBlock - 1) / mcBlock
			ParallelFor(blocks, func(ib int) {
				ic := ib * mcBlock
				mb := min(mcBlock, m-ic)
				mpan := (mb + mr - 1) / mr
				var edge *[]float32 // the packed partial panel of op(A), if any
				if mb%mr != 0 {
					edge = getBuf(mr * kb)
					packA(*edge, transA, a, lda, ic+(mpan-1)*mr, mb%mr, pc, kb)
				}
				var tile [mr * nr]float32
				for jp := range npan {
					j0 := jc + jp*nr
					nj := min(nr, jc+nb-j0)
					var pb *float32
					bps := nr
					if transB || nj < nr {
						pb = &(*bp)[jp*nr*kb]
					} else {
						pb, bps = &b[pc*ldb+j0], ldb
					}
					for ip := range mpan {
						i0 := ic + ip*mr
						rows := min(mr, ic+mb-i0)
						pa, rs, ps := &a[i0*ars+pc*aps], ars, aps
						if rows < mr {
							pa, rs, ps = &(*edge)[0], 1, mr
						}
						if nj == nr && rows == mr { // a full tile: straight into C
							kern6x16(kb, pa, rs, ps, pb, bps, &c[i0*ldc+j0], ldc, acc)
							continue
						}
						kern6x16(kb, pa, rs, ps, pb, bps, &tile[0], nr, false)
						for i := range rows {
							row := c[(i0+i)*ldc+j0 : (i0+i)*ldc+j0+nj]
							t := tile[i*nr : i*nr+nj]
							if !acc {
								copy(row, t)
								continue
							}
							for j := range row {
								row[j] += t[j]
							}
						}
					}
				}
				if edge != nil {
					packPool.Put(edge)
				}
			})
			if bp != nil {
				packPool.Put(bp)
			}
		}
	}
}

// packA copies rows r0..r0+rows-1 (rows <= mr) of op(A), columns pc..pc+kb,
// into one panel of mr rows: for each p, the mr values of those rows, zero
// past the last one.
func packA(pan []float32, trans bool, a []float32, lda, r0, rows, pc, kb int) {
	pan = pan[:mr*kb]
	clear(pan)
	if trans { // op(A)[r][p] = a[p*lda+r]
		for p := range kb {
			copy(pan[p*mr:p*mr+rows], a[(pc+p)*lda+r0:(pc+p)*lda+r0+rows])
		}
		return
	}
	for i := range rows {
		for p, v := range a[(r0+i)*lda+pc : (r0+i)*lda+pc+kb] {
			pan[p*mr+i] = v
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
