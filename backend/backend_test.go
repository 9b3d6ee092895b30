package backend

import (
	"fmt"
	"testing"
)

// span is a segment of size bytes at base of memory object obj, for the
// checks written here once.
type span struct {
	base, size uint64
	obj        string
}

func (s span) Name() string  { return "span" }
func (s span) Size() int64   { return int64(s.size) }
func (s span) Object() any   { return s.obj }
func (s span) Base() uint64  { return s.base }
func (s span) Verify() error { return nil }
func (s span) Close() error  { return nil }

func (s span) Check(off, n, align int64) error {
	if off < 0 || n <= 0 || uint64(off+n) > s.size || (align > 1 && off%align != 0) {
		return fmt.Errorf("range [%d, +%d) refused", off, n)
	}
	return nil
}

func TestOverlaps(t *testing.T) {
	a, b := span{0x1000, 4096, ""}, span{0x2000, 4096, ""} // b starts where a ends
	// f1 and f2 are two attachments of one file (a hard link), g another file.
	f1, f2, g := span{0, 4096, "file1"}, span{0, 4096, "file1"}, span{0, 4096, "file2"}
	tests := []struct {
		name string
		r, o Ref
		want bool
	}{
		{"same range", Ref{a, 0, 16}, Ref{a, 0, 16}, true},
		{"one byte shared", Ref{a, 0, 16}, Ref{a, 15, 16}, true},
		{"adjacent", Ref{a, 0, 16}, Ref{a, 16, 16}, false},
		{"inside", Ref{a, 0, 4096}, Ref{a, 100, 4}, true},
		{"end of one segment, start of the next", Ref{a, 4080, 16}, Ref{b, 0, 16}, false},
		{"across segments by address", Ref{a, 4080, 32}, Ref{b, 0, 16}, true},
		{"empty", Ref{a, 0, 0}, Ref{a, 0, 16}, false},
		{"no segment", Ref{}, Ref{a, 0, 16}, false},
		{"one file through two attachments", Ref{f1, 64, 16}, Ref{f2, 72, 16}, true},
		{"one file, disjoint ranges", Ref{f1, 0, 16}, Ref{f2, 16, 16}, false},
		{"two files at the same offsets", Ref{f1, 0, 16}, Ref{g, 0, 16}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.r.Overlaps(tc.o); got != tc.want {
				t.Errorf("%+v overlaps %+v = %v, want %v", tc.r, tc.o, got, tc.want)
			}
			if got := tc.o.Overlaps(tc.r); got != tc.want {
				t.Errorf("not symmetric: %v", got)
			}
		})
	}
}

func TestResolve(t *testing.T) {
	s := span{0x1000, 64, ""}
	if r, err := Resolve(s, 8, 16, 4); err != nil || r.Off != 8 || r.Len != 16 || r.Seg != s {
		t.Errorf("Resolve = %+v, %v", r, err)
	}
	if _, err := Resolve(s, 60, 16, 4); err == nil {
		t.Error("a range past the end was resolved")
	}
}
