package ipcbridge

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// makeSegment creates dir/name with size random bytes and the given mode.
func makeSegment(t *testing.T, dir, name string, size int, mode os.FileMode) []byte {
	t.Helper()
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(uint64(size), 1))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil { // not subject to the umask
		t.Fatal(err)
	}
	return data
}

func TestMapGoodSegment(t *testing.T) {
	dir := t.TempDir()
	const size = 3 * 4096
	data := makeSegment(t, dir, "sonar-good", size, 0o600)
	m, err := ShmMapper{Dir: dir}.Map("sonar-good", size)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Name() != "sonar-good" || m.Size() != size {
		t.Errorf("Name %q Size %d", m.Name(), m.Size())
	}
	b, err := m.Bytes(4096, 1024, 4)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, data[4096:4096+1024]) {
		t.Error("mapped bytes differ from the file")
	}
	if len(b) != 1024 || cap(b) != 1024 {
		t.Errorf("len %d cap %d: the slice must not reach past its range", len(b), cap(b))
	}
	// MAP_SHARED: a write through the mapping reaches the file.
	copy(b, "written by the server")
	onDisk, err := os.ReadFile(filepath.Join(dir, "sonar-good"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDisk[4096:4096+21], []byte("written by the server")) {
		t.Error("write through the mapping not visible in the file")
	}
	// The whole segment, and single bytes at both ends.
	for _, c := range [][3]int64{{0, size, 1}, {0, 1, 1}, {size - 1, 1, 1}, {size - 4, 4, 4}} {
		if _, err := m.Bytes(c[0], c[1], c[2]); err != nil {
			t.Errorf("Bytes(%d, %d, %d): %v", c[0], c[1], c[2], err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "sonar-good")); err != nil {
		t.Errorf("without Unlink the name must stay: %v", err)
	}
}

func TestMapUnlink(t *testing.T) {
	dir := t.TempDir()
	data := makeSegment(t, dir, "sonar-unlink", 8192, 0o600)
	m, err := ShmMapper{Dir: dir, Unlink: true}.Map("sonar-unlink", 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := os.Stat(filepath.Join(dir, "sonar-unlink")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("segment name still there after Map with Unlink: %v", err)
	}
	b, err := m.Bytes(0, 8192, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, data) {
		t.Error("memory of an unlinked segment differs")
	}
	// Mapping the same name again fails: it is gone.
	if _, err := (ShmMapper{Dir: dir, Unlink: true}).Map("sonar-unlink", 8192); err == nil {
		t.Error("second Map of an unlinked segment succeeded")
	}
}

func TestMapRejects(t *testing.T) {
	dir := t.TempDir()
	makeSegment(t, dir, "sonar-ok", 4096, 0o600)
	makeSegment(t, dir, "sonar-group", 4096, 0o640)
	makeSegment(t, dir, "sonar-other", 4096, 0o604)
	makeSegment(t, dir, "sonar-exec", 4096, 0o610)
	if err := os.Symlink(filepath.Join(dir, "sonar-ok"), filepath.Join(dir, "sonar-link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "sonar-dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	// A file outside dir that path traversal would reach.
	makeSegment(t, filepath.Dir(dir), filepath.Base(dir)+"-x", 4096, 0o600)

	cases := []struct {
		name    string
		shm     string
		size    int64
		wantErr string
		errName bool // errors.Is(err, ErrName)
	}{
		{"path traversal", "sonar-../" + filepath.Base(dir) + "-x", 4096, "not allowed", true},
		{"dot dot", "sonar-..", 4096, "not allowed", true},
		{"dot", "sonar-.", 4096, "not allowed", true},
		{"other prefix", "other", 4096, "not allowed", true},
		{"empty", "", 4096, "not allowed", true},
		{"prefix only", "sonar-", 4096, "not allowed", true},
		{"slash", "sonar-a/b", 4096, "not allowed", true},
		{"absolute", "/sonar-ok", 4096, "not allowed", true},
		{"space", "sonar-o k", 4096, "not allowed", true},
		{"newline", "sonar-ok\n", 4096, "not allowed", true},
		{"nul", "sonar-ok\x00", 4096, "not allowed", true},
		{"too long", "sonar-" + strings.Repeat("a", 201), 4096, "not allowed", true},
		{"missing", "sonar-missing", 4096, "no such file", false},
		{"size smaller than file", "sonar-ok", 4095, "client said 4095", false},
		{"size larger than file", "sonar-ok", 8192, "client said 8192", false},
		{"size zero", "sonar-ok", 0, "out of range", false},
		{"size negative", "sonar-ok", -4096, "out of range", false},
		{"size too large", "sonar-ok", MaxSegmentBytes + 1, "out of range", false},
		{"symlink", "sonar-link", 4096, "too many levels of symbolic links", false},
		{"group readable", "sonar-group", 4096, "group/other", false},
		{"other readable", "sonar-other", 4096, "group/other", false},
		{"group executable", "sonar-exec", 4096, "group/other", false},
		{"directory", "sonar-dir", 4096, "is a directory", false},
	}
	for _, tc := range cases {
		for _, unlink := range []bool{false, true} {
			m, err := ShmMapper{Dir: dir, Unlink: unlink}.Map(tc.shm, tc.size)
			if err == nil {
				m.Close()
				t.Errorf("%s: Map(%q, %d) succeeded", tc.name, tc.shm, tc.size)
				continue
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %q does not mention %q", tc.name, err, tc.wantErr)
			}
			if errors.Is(err, ErrName) != tc.errName {
				t.Errorf("%s: errors.Is(err, ErrName) = %v", tc.name, !tc.errName)
			}
		}
	}
	// Rejected segments are left alone (not unlinked).
	for _, name := range []string{"sonar-ok", "sonar-group", "sonar-link"} {
		if _, err := os.Lstat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s removed by a failed Map: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), filepath.Base(dir)+"-x")); err != nil {
		t.Errorf("file outside the directory touched: %v", err)
	}
}

func TestCheckName(t *testing.T) {
	cases := []struct {
		name string
		ok   bool
	}{
		{"sonar-a", true},
		{"sonar-123-abc_DEF.x-y", true},
		{"sonar-...", true}, // a plain file name, no traversal
		{"sonar-" + strings.Repeat("z", 200), true},
		{"sonar-" + strings.Repeat("z", 201), false},
		{"sonar-", false},
		{"sonar-.", false},
		{"sonar-..", false},
		{"sonar-../x", false},
		{"sonar-a/b", false},
		{"Sonar-a", false},
		{"xsonar-a", false},
		{"sonar-é", false},
		{"sonar-a\n", false},
		{"", false},
	}
	for _, tc := range cases {
		err := CheckName(tc.name)
		if (err == nil) != tc.ok {
			t.Errorf("CheckName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrName) {
			t.Errorf("CheckName(%q): error does not wrap ErrName", tc.name)
		}
	}
}

func TestBytesBounds(t *testing.T) {
	dir := t.TempDir()
	const size = 4096
	makeSegment(t, dir, "sonar-b", size, 0o600)
	m, err := ShmMapper{Dir: dir}.Map("sonar-b", size)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name         string
		off, n, algn int64
		wantErr      string // "" means ok
	}{
		{"whole", 0, size, 4, ""},
		{"last element", size - 4, 4, 4, ""},
		{"align 0 means none", 3, 5, 0, ""},
		{"align 1", 3, 5, 1, ""},
		{"negative offset", -4, 4, 4, "invalid"},
		{"zero length", 0, 0, 4, "invalid"},
		{"negative length", 8, -4, 4, "invalid"},
		{"past end by one", size - 4, 5, 1, "outside"},
		{"offset at end", size, 1, 1, "outside"},
		{"offset past end", size + 4, 4, 4, "outside"},
		{"length overflows", 8, math.MaxInt64, 1, "outside"},
		{"offset near MaxInt64", math.MaxInt64 - 3, 4, 1, "outside"},
		{"both huge", math.MaxInt64 / 2, math.MaxInt64/2 + 2, 1, "outside"},
		{"misaligned for float32", 2, 4, 4, "not aligned"},
		{"misaligned for bfloat16", 1, 2, 2, "not aligned"},
		{"aligned for bfloat16", 2, 2, 2, ""},
	}
	for _, tc := range cases {
		b, err := m.Bytes(tc.off, tc.n, tc.algn)
		if tc.wantErr == "" {
			if err != nil || int64(len(b)) != tc.n {
				t.Errorf("%s: Bytes(%d, %d, %d) = %d bytes, %v", tc.name, tc.off, tc.n, tc.algn, len(b), err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: Bytes(%d, %d, %d): error %v, want one mentioning %q", tc.name, tc.off, tc.n, tc.algn, err, tc.wantErr)
		}
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Bytes(0, 4, 4); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Bytes after Close: %v, want a 'closed' error", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
