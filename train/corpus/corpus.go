// Package corpus is the Go trainer's data: it reads text files (a file or a
// directory tree, or by default the Go standard library's sources that ship
// with every Go installation) into one byte string, splits off a held-out
// tail, and samples random windows of bytes as training batches.
package corpus

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
)

// Corpus is the text, split into training bytes and a held-out tail.
type Corpus struct {
	Source string // what was read, for people
	Files  int
	Train  []byte
	Held   []byte
}

// Options say what to read.
type Options struct {
	// Paths are files or directories; empty: the Go standard library
	// sources (GoSources).
	Paths []string
	// Ext keeps only files with these extensions (".go"); empty: every
	// file that looks like text. The default corpus reads ".go" files.
	Ext []string
	// MaxBytes caps the text read (0: no cap).
	MaxBytes int
	// HeldFraction of the bytes, taken from the end, is held out.
	HeldFraction float64
	// Seed shuffles the file order, so a cap samples the whole tree.
	Seed uint64
}

// GoSources returns the directory of the Go standard library's sources:
// $GOROOT/src from `go env GOROOT`, or else the GOROOT this binary was
// built with.
func GoSources() (string, error) {
	root := ""
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		root = strings.TrimSpace(string(out))
	}
	if root == "" {
		root = runtime.GOROOT() //nolint:staticcheck // fallback when no go command is on PATH
	}
	if root == "" {
		return "", errors.New("cannot find GOROOT: no go command on PATH and none built in")
	}
	src := filepath.Join(root, "src")
	if st, err := os.Stat(src); err != nil || !st.IsDir() {
		return "", fmt.Errorf("go standard library sources not found at %s", src)
	}
	return src, nil
}

// Load reads the corpus.
func Load(o Options) (*Corpus, error) {
	if o.HeldFraction < 0 || o.HeldFraction >= 1 {
		return nil, fmt.Errorf("corpus: held-out fraction %v: want [0, 1)", o.HeldFraction)
	}
	paths, source := o.Paths, strings.Join(o.Paths, ", ")
	ext := o.Ext
	if len(paths) == 0 {
		src, err := GoSources()
		if err != nil {
			return nil, fmt.Errorf("corpus: %w", err)
		}
		paths, source = []string{src}, "Go standard library sources ("+src+")"
		if len(ext) == 0 {
			ext = []string{".go"}
		}
	}
	var files []string
	for _, p := range paths {
		err := filepath.WalkDir(p, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() {
				if path != p && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
					return filepath.SkipDir
				}
				return nil
			}
			if d.Type().IsRegular() && (len(ext) == 0 || slices.Contains(ext, filepath.Ext(path))) {
				files = append(files, path)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("corpus: read %s: %w", p, err)
		}
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("corpus: no files in %s", source)
	}
	rng := rand.New(rand.NewPCG(o.Seed, 0xc0ffee))
	rng.Shuffle(len(files), func(i, j int) { files[i], files[j] = files[j], files[i] })
	var buf bytes.Buffer
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("corpus: %w", err)
		}
		if len(b) == 0 || bytes.IndexByte(b[:min(len(b), 8192)], 0) >= 0 {
			continue // empty or binary
		}
		if o.MaxBytes > 0 && buf.Len()+len(b) > o.MaxBytes {
			b = b[:o.MaxBytes-buf.Len()]
		}
		buf.Write(b)
		n++
		if o.MaxBytes > 0 && buf.Len() >= o.MaxBytes {
			break
		}
	}
	data := buf.Bytes()
	if len(data) == 0 {
		return nil, fmt.Errorf("corpus: no text in %s", source)
	}
	cut := len(data) - int(float64(len(data))*o.HeldFraction)
	return &Corpus{Source: source, Files: n, Train: data[:cut], Held: data[cut:]}, nil
}

// Sampler draws batches of random windows from data.
type Sampler struct {
	data []byte
	seq  int
	rng  *rand.Rand
}

// NewSampler returns a sampler of windows of seq+1 bytes (inputs and the
// next-byte targets) from data.
func NewSampler(data []byte, seq int, seed uint64) (*Sampler, error) {
	if seq < 1 || len(data) < seq+1 {
		return nil, fmt.Errorf("corpus: %d bytes cannot hold a window of %d+1", len(data), seq)
	}
	return &Sampler{data: data, seq: seq, rng: rand.New(rand.NewPCG(seed, 0xba7c4))}, nil
}

// Batch fills inputs and targets (batch*seq each) with len(inputs)/seq
// random windows: targets are the inputs shifted by one byte.
func (s *Sampler) Batch(inputs, targets []int32) {
	for b := range len(inputs) / s.seq {
		o := s.rng.IntN(len(s.data) - s.seq)
		for i := range s.seq {
			inputs[b*s.seq+i] = int32(s.data[o+i])
			targets[b*s.seq+i] = int32(s.data[o+i+1])
		}
	}
}
