package corpus

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, dir, name string, data []byte) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "a.go", []byte("package a\n"))
	write(t, dir, "b.txt", []byte("hello text\n"))
	write(t, dir, "sub/c.go", []byte("package c\n"))
	write(t, dir, "bin.dat", []byte{1, 2, 0, 3})
	write(t, dir, ".git/x.go", []byte("hidden\n"))
	write(t, dir, "testdata/y.go", []byte("fixture\n"))
	write(t, dir, "empty.go", nil)
	cases := []struct {
		name      string
		o         Options
		files     int
		bytes     int
		held      int
		wantError string
	}{
		{"all text", Options{Paths: []string{dir}}, 3, 31, 0, ""},
		{"go only", Options{Paths: []string{dir}, Ext: []string{".go"}}, 2, 20, 0, ""},
		{"one file", Options{Paths: []string{filepath.Join(dir, "b.txt")}}, 1, 11, 0, ""},
		{"capped", Options{Paths: []string{dir}, MaxBytes: 15}, 2, 15, 0, ""},
		{"held out", Options{Paths: []string{dir}, HeldFraction: 0.5}, 3, 31, 15, ""},
		{"no match", Options{Paths: []string{dir}, Ext: []string{".rs"}}, 0, 0, 0, "no files"},
		{"only binary", Options{Paths: []string{filepath.Join(dir, "bin.dat")}}, 0, 0, 0, "no text"},
		{"missing", Options{Paths: []string{filepath.Join(dir, "nope")}}, 0, 0, 0, "nope"},
		{"bad fraction", Options{Paths: []string{dir}, HeldFraction: 1}, 0, 0, 0, "fraction"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Load(c.o)
			if c.wantError != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantError) {
					t.Fatalf("error %v, want one mentioning %q", err, c.wantError)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Files != c.files || len(got.Train)+len(got.Held) != c.bytes || len(got.Held) != c.held {
				t.Errorf("%d files, %d+%d bytes; want %d files, %d bytes, %d held out", got.Files, len(got.Train), len(got.Held), c.files, c.bytes, c.held)
			}
		})
	}
}

func TestLoadSeedOrder(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"a", "b", "c", "d", "e", "f"} {
		write(t, dir, n+".txt", []byte(strings.Repeat(n, 4)))
	}
	a, err := Load(Options{Paths: []string{dir}, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Load(Options{Paths: []string{dir}, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Load(Options{Paths: []string{dir}, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Train, b.Train) {
		t.Error("same seed, different text order")
	}
	if bytes.Equal(a.Train, c.Train) {
		t.Error("different seeds, same text order")
	}
}

func TestGoSources(t *testing.T) {
	src, err := GoSources()
	if err != nil {
		t.Skipf("no Go sources here: %v", err)
	}
	if _, err := os.Stat(filepath.Join(src, "fmt", "print.go")); err != nil {
		t.Fatalf("GoSources() = %s without fmt/print.go: %v", src, err)
	}
	c, err := Load(Options{MaxBytes: 100000, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Train) != 100000 || !bytes.Contains(c.Train, []byte("package ")) {
		t.Errorf("default corpus: %d bytes, want 100000 of Go source", len(c.Train))
	}
}

func TestSampler(t *testing.T) {
	data := []byte("abcdefghijklmnopqrstuvwxyz")
	cases := []struct {
		name    string
		seq, n  int
		wantErr bool
	}{
		{"windows", 5, 4, false},
		{"whole text", 25, 2, false},
		{"too long", 26, 1, true},
		{"zero", 0, 1, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, err := NewSampler(data, c.seq, 1)
			if (err != nil) != c.wantErr {
				t.Fatalf("error %v, want error %v", err, c.wantErr)
			}
			if err != nil {
				return
			}
			in, tgt := make([]int32, c.seq*c.n), make([]int32, c.seq*c.n)
			s.Batch(in, tgt)
			for b := range c.n {
				for i := range c.seq {
					x, y := in[b*c.seq+i], tgt[b*c.seq+i]
					if y != x+1 || (i > 0 && x != in[b*c.seq+i-1]+1) {
						t.Fatalf("window %d: inputs %v targets %v are not consecutive text shifted by one", b, in, tgt)
					}
				}
			}
		})
	}
}
