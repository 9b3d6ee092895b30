package kernels

import (
	"fmt"
	"sync/atomic"
	"testing"
	"unsafe"
)

func TestAllocAt(t *testing.T) {
	for _, off := range []int{0, 256, 1020, 2048 + 64*7, 4088, 4096 + 64} {
		for _, n := range []int{1, 1000, 5000} {
			a := AllocAt[float32](n, off)
			b := AllocAt[float64](n, off&^7)
			if len(a) != n || cap(a) != n || len(b) != n || cap(b) != n {
				t.Fatalf("AllocAt(%d, %d): len %d cap %d, float64 len %d cap %d", n, off, len(a), cap(a), len(b), cap(b))
			}
			if got := uintptr(unsafe.Pointer(&a[0])) % 4096; got != uintptr(off%4096) {
				t.Errorf("float32 AllocAt(%d, %d) starts at %d mod 4096", n, off, got)
			}
			if got := uintptr(unsafe.Pointer(&b[0])) % 4096; got != uintptr((off&^7)%4096) {
				t.Errorf("float64 AllocAt(%d, %d) starts at %d mod 4096", n, off&^7, got)
			}
		}
	}
}

func TestParallelFor(t *testing.T) {
	for _, n := range []int{0, 1, 2, 7, 1000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			hits := make([]atomic.Int32, n)
			ParallelFor(n, func(i int) { hits[i].Add(1) })
			for i := range hits {
				if h := hits[i].Load(); h != 1 {
					t.Fatalf("index %d called %d times", i, h)
				}
			}
		})
	}
}

func TestBytes(t *testing.T) {
	if Bytes(nil) != nil {
		t.Error("Bytes(nil) is not nil")
	}
	w := []float32{1, -2}
	b := Bytes(w)
	if len(b) != 8 || b[3] != 0x3f || b[7] != 0xc0 {
		t.Errorf("Bytes(%v) = %x", w, b)
	}
}
