package ipcbridge

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BenchmarkReadAtPieces reads 32 MiB of this process's memory through
// ProcessMemory.ReadAt (process_vm_readv), which is how sonard reads a
// zero-copy gradient, and copies it with copy() for comparison. The piece
// sizes bracket the engine's read size (optimizer's readBytes: 128 KiB since
// 2026-12-05, 32 KiB of float32 before); "thp" puts the source on
// transparent huge pages (madvise), which a trainer's allocator does not do
// by default. Measured on the 2-core AMD EPYC VM: 2026-12-01, 2.7-3.3 GB/s
// for every piece size from 32 KiB to 1 MiB, 4.3-4.4 GB/s on huge pages,
// 8.5-9.9 GB/s for copy(); 2026-12-05 (three runs), 4.7-5.6 GB/s in 32 KiB
// pieces, 5.5-6.5 in 128 KiB, 6.2-6.5 in 1 MiB, 18.7-20.5 for copy(): the
// cost is mostly per page, and about 2 us per call.
func BenchmarkReadAtPieces(b *testing.B) {
	const n = 32 << 20
	for _, thp := range []bool{false, true} {
		raw := make([]byte, n+(2<<20))
		start := uintptr(unsafe.Pointer(&raw[0]))
		skip := int(((start + (2<<20 - 1)) &^ (2<<20 - 1)) - start) // to a 2 MiB boundary
		src := raw[skip : skip+n]
		if thp {
			if err := unix.Madvise(src, unix.MADV_HUGEPAGE); err != nil {
				b.Skipf("madvise(MADV_HUGEPAGE): %v", err)
			}
		}
		for i := range src { // faults the pages in (huge ones where advised)
			src[i] = byte(i * 7)
		}
		p := &ProcessMemory{pid: os.Getpid()}
		base := uint64(uintptr(unsafe.Pointer(&src[0])))
		pieces := []int{32 << 10, 128 << 10, 1 << 20}
		if thp {
			pieces = []int{32 << 10}
		}
		for _, piece := range pieces {
			name := fmt.Sprintf("readv-%dKiB", piece>>10)
			if thp {
				name += "-thp"
			}
			b.Run(name, func(b *testing.B) {
				dst := make([]byte, piece)
				b.SetBytes(n)
				for i := 0; i < b.N; i++ {
					for off := 0; off < n; off += piece {
						if err := p.ReadAt(dst, base+uint64(off)); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		}
		if !thp {
			b.Run("copy-32KiB", func(b *testing.B) {
				dst := make([]byte, 32<<10)
				b.SetBytes(n)
				for i := 0; i < b.N; i++ {
					for off := 0; off < n; off += len(dst) {
						copy(dst, src[off:])
					}
				}
			})
		}
	}
}

// BenchmarkReadAtWorkers is the read a layer request makes: a 2 MiB
// gradient (in cache, as backward left it), in 32 KiB pieces (the engine's
// read size until 2026-12-05) by one or two goroutines, as sonard's workers
// take them, against copy(). Measured
// 2026-12-04 on the 2-core AMD EPYC VM (two runs): process_vm_readv 7.4-8.5
// GB/s on one goroutine, 10-14 on two; copy() 27-37 and 40-45. The cost is
// per 4 KiB page (pinning and mapping it), about 0.4 us a page.
func BenchmarkReadAtWorkers(b *testing.B) {
	const n, piece = 2 << 20, 32 << 10
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 7)
	}
	p := &ProcessMemory{pid: os.Getpid()}
	base := uint64(uintptr(unsafe.Pointer(&src[0])))
	for _, workers := range []int{1, 2} {
		for _, readv := range []bool{true, false} {
			name := fmt.Sprintf("copy-%dworkers", workers)
			if readv {
				name = fmt.Sprintf("readv-%dworkers", workers)
			}
			b.Run(name, func(b *testing.B) {
				b.SetBytes(n)
				for i := 0; i < b.N; i++ {
					var wg sync.WaitGroup
					for w := 0; w < workers; w++ {
						wg.Add(1)
						go func(w int) {
							defer wg.Done()
							dst := make([]byte, piece)
							for off := w * piece; off < n; off += workers * piece {
								if !readv {
									copy(dst, src[off:off+piece])
								} else if err := p.ReadAt(dst, base+uint64(off)); err != nil {
									b.Error(err)
									return
								}
							}
						}(w)
					}
					wg.Wait()
				}
			})
		}
	}
}
