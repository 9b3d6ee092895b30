package hfmoe

import (
	"testing"
	"unsafe"
)

func TestAllocAt(t *testing.T) {
	for _, off := range []int{0, 256, 2048 + 64*7, 4092} {
		a := allocAt[float32](1000, off)
		b := allocAt[float64](10, off&^7)
		if len(a) != 1000 || cap(a) != 1000 || uintptr(unsafe.Pointer(&a[0]))%4096 != uintptr(off) {
			t.Errorf("float32 at %d: address mod 4096 = %d", off, uintptr(unsafe.Pointer(&a[0]))%4096)
		}
		if uintptr(unsafe.Pointer(&b[0]))%4096 != uintptr(off&^7) {
			t.Errorf("float64 at %d: address mod 4096 = %d", off&^7, uintptr(unsafe.Pointer(&b[0]))%4096)
		}
	}
}
