package goclient

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/optimizer"
)

var (
	buildOnce sync.Once
	buildDir  string
	sonardBin string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// buildSonard builds cmd/sonard with the repository's one build entry
// point (scripts/build-go) once per test binary.
func buildSonard() (string, error) {
	buildOnce.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "goclient-test-"); buildErr != nil {
			return
		}
		sonardBin = filepath.Join(buildDir, "sonard")
		out, err := exec.Command(filepath.Join("..", "..", "scripts", "build-go"), "-o", buildDir, "sonard").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("scripts/build-go sonard: %v\n%s", err, out)
		}
	})
	return sonardBin, buildErr
}

// startSonard builds cmd/sonard, starts it on an ipc:// socket in a fresh
// private directory and returns a connected client. The server is shut
// down when the test ends.
func startSonard(t *testing.T) *Client {
	t.Helper()
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Skip("no /dev/shm")
	}
	bin, err := buildSonard()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "sonard.sock") // sonard creates run/ with mode 0700
	addr := "ipc://" + sock
	var logs bytes.Buffer
	const token = "the-owner-token-of-this-test"
	tokenFile := filepath.Join(dir, "owner.token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--listen", addr, "--log-level", "warn", "--workers", "2", "--admin-token-file", tokenFile)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sonard: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("sonard exited before listening: %v\n%s", err, logs.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("sonard did not create %s\n%s", sock, logs.String())
		}
	}
	if st, err := os.Stat(filepath.Dir(sock)); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("socket directory: %v, mode %v, want 0700", err, st.Mode().Perm())
	}
	c, err := Dial(addr, 30*time.Second)
	if err != nil {
		_ = cmd.Process.Kill()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.SetTimeout(3 * time.Second)
		err := c.Shutdown(token)
		c.Close()
		if err != nil {
			// sonard closes its socket with linger 0 right after queueing
			// this reply, so the reply can be lost; what matters is that
			// the server stops cleanly.
			t.Logf("shutdown sent, no reply: %v", err)
		}
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("sonard exited with %v\n%s", err, logs.String())
			}
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			t.Errorf("sonard did not stop\n%s", logs.String())
		}
	})
	return c
}

// newSegment creates a segment, attaches it and checks that the server
// unlinked its name.
func newSegment(t *testing.T, c *Client, size int) (*Segment, uint32) {
	t.Helper()
	seg, err := CreateSegment("", NewSegmentName(), size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := seg.Close(); err != nil {
			t.Error(err)
		}
	})
	if st, err := os.Stat(seg.Path()); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("segment file: %v, mode %v, want 0600", err, st.Mode().Perm())
	}
	id, err := c.Attach(seg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(seg.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("segment %s still has a name after attach: %v", seg.Name(), err)
	}
	return seg, id
}

// fill writes n random, never zero, values of dtype d with scale sd.
func fill(rng *rand.Rand, b []byte, d optimizer.DType, sd float64) {
	for {
		ok := true
		switch d {
		case optimizer.Float32:
			x := optimizer.F32s(b)
			for i := range x {
				x[i] = float32(rng.NormFloat64() * sd)
				ok = ok && x[i] != 0
			}
		case optimizer.BFloat16:
			x := optimizer.U16s(b)
			for i := range x {
				x[i] = optimizer.F32ToBF16(float32(rng.NormFloat64() * sd))
				ok = ok && x[i]&0x7fff != 0
			}
		}
		if ok {
			return
		}
	}
}

type tcase struct {
	dtype  optimizer.DType
	numel  int
	hyper  optimizer.Hyper
	accum  int // micro-batches per step (1: no accumulation)
	poff   int // parameter offset in the segment
	goff   int // gradient offset
	id     uint32
	init   []byte // the parameter before training
	local  *optimizer.Tensor
	remote []byte // the parameter in shared memory
}

// The same gradients applied by a real sonard (through shared memory and
// the protocol) and by the in-process engine the Go trainer uses leave the
// same parameter and optimizer-state bytes.
func TestSonardMatchesInProcessEngine(t *testing.T) {
	c := startSonard(t)
	hello, err := c.Hello()
	if err != nil {
		t.Fatal(err)
	}
	if hello.Protocol != ipc.Version || hello.Sqrt != "ieee" {
		t.Fatalf("hello: %+v", hello)
	}
	def := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	noWD := optimizer.Hyper{LR: 3e-2, Beta1: 0.8, Beta2: 0.99, Eps: 1e-6}
	ams := optimizer.Hyper{LR: 2e-3, Beta1: 0.3, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1, Amsgrad: true, Maximize: true}
	var cases []*tcase
	for _, d := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		for i, n := range []int{1, 7, 33, 1000, 4097, 70001} {
			h := []optimizer.Hyper{def, noWD, ams}[i%3]
			cases = append(cases, &tcase{dtype: d, numel: n, hyper: h, accum: 1 + i%2})
		}
	}
	// Lay the tensors out in one parameter and one gradient segment (each
	// offset aligned to 64 bytes), as the Python client does.
	pbytes, gbytes := 0, 0
	for _, tc := range cases {
		nb := tc.numel * tc.dtype.Size()
		tc.poff, tc.goff = pbytes, gbytes
		pbytes += (nb + 63) &^ 63
		gbytes += (nb + 63) &^ 63
	}
	rng := rand.New(rand.NewPCG(2026, 11))
	pseg, pid := newSegment(t, c, pbytes)
	gseg, gid := newSegment(t, c, gbytes)
	eng := optimizer.NewEngine()
	eng.Workers = 2
	specs := make([]ipc.TensorSpec, len(cases))
	for i, tc := range cases {
		nb := tc.numel * tc.dtype.Size()
		tc.remote = pseg.Bytes()[tc.poff : tc.poff+nb]
		fill(rng, tc.remote, tc.dtype, 1)
		tc.init = bytes.Clone(tc.remote)
		name := fmt.Sprintf("t%d.%s.%d", i, tc.dtype, tc.numel)
		tc.local, err = optimizer.NewTensor(name, tc.dtype, tc.numel, tc.hyper, bytes.Clone(tc.remote))
		if err != nil {
			t.Fatal(err)
		}
		specs[i] = ipc.TensorSpec{Name: name, Shape: []int64{int64(tc.numel)}, DType: tc.dtype.String(),
			Param: ipc.MemRef{Seg: pid, Offset: int64(tc.poff), Bytes: int64(nb)}, Hyper: HyperMsg(tc.hyper)}
	}
	ids, err := c.Register(specs)
	if err != nil {
		t.Fatal(err)
	}
	for i, tc := range cases {
		tc.id = ids[i]
	}
	const steps = 5
	for step := int64(1); step <= steps; step++ {
		lrScale := 1 / float64(step) // a schedule: the LR reaches the server through the scalars
		for micro := 0; micro < 2; micro++ {
			var items []ipc.StepItem
			for _, tc := range cases {
				if micro >= tc.accum {
					continue
				}
				apply := micro == tc.accum-1
				nb := tc.numel * tc.dtype.Size()
				g := gseg.Bytes()[tc.goff : tc.goff+nb]
				fill(rng, g, tc.dtype, 0.1)
				h := tc.hyper
				h.LR *= lrScale
				sc := optimizer.ScalarsFor(h, step)
				if apply {
					err = eng.Apply(tc.local, g, sc)
				} else {
					err = eng.Accumulate(tc.local, g)
				}
				if err != nil {
					t.Fatal(err)
				}
				items = append(items, ipc.StepItem{Tensor: tc.id, Grad: ipc.MemRef{Seg: gid, Offset: int64(tc.goff), Bytes: int64(nb)},
					Apply: apply, Step: step, Scalars: ScalarsMsg(sc)})
			}
			rep, err := c.Step(items)
			if err != nil {
				t.Fatalf("step %d micro-batch %d: %v", step, micro, err)
			}
			if rep.Applied+rep.Accumulated != len(items) {
				t.Fatalf("step %d: reply %+v for %d items", step, rep, len(items))
			}
		}
		for _, tc := range cases {
			if !bytes.Equal(tc.remote, tc.local.Param) {
				t.Fatalf("step %d: %s: sonard's parameter differs from the in-process engine's", step, tc.local.Name)
			}
		}
	}
	for _, tc := range cases {
		// bfloat16 steps of lr 1e-3 may round away on a one-element tensor.
		if bytes.Equal(tc.remote, tc.init) && (tc.dtype == optimizer.Float32 || tc.numel > 1) {
			t.Errorf("%s: parameter never changed", tc.local.Name)
		}
	}
	// The optimizer state too, exported through a third segment.
	maxNB := 0
	for _, tc := range cases {
		maxNB = max(maxNB, tc.numel*tc.dtype.Size())
	}
	sseg, sid := newSegment(t, c, 3*maxNB)
	for _, tc := range cases {
		nb := tc.numel * tc.dtype.Size()
		ref := func(k int) ipc.MemRef { return ipc.MemRef{Seg: sid, Offset: int64(k * maxNB), Bytes: int64(nb)} }
		x := ipc.StateXfer{Tensor: tc.id, ExpAvg: ref(0), ExpAvgSq: ref(1)}
		if tc.hyper.Amsgrad {
			x.MaxExpAvgSq = ref(2)
		}
		rep, err := c.Export(x)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Step != steps || tc.local.Step != steps {
			t.Errorf("%s: server step %d, local %d, want %d", tc.local.Name, rep.Step, tc.local.Step, steps)
		}
		s := sseg.Bytes()
		if !bytes.Equal(s[:nb], tc.local.ExpAvg) || !bytes.Equal(s[maxNB:maxNB+nb], tc.local.ExpAvgSq) ||
			(tc.hyper.Amsgrad && !bytes.Equal(s[2*maxNB:2*maxNB+nb], tc.local.MaxExpAvgSq)) {
			t.Errorf("%s: exported optimizer state differs from the in-process engine's", tc.local.Name)
		}
	}
	st, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Tensors != len(cases) || st.Errors != 0 {
		t.Errorf("stats: %d tensors, %d errors; want %d and 0", st.Tensors, st.Errors, len(cases))
	}
}

// A request the server refuses comes back as an ErrServer error, and the
// session keeps working.
func TestRefusedRequest(t *testing.T) {
	c := startSonard(t)
	_, err := c.Step([]ipc.StepItem{{Tensor: 99, Apply: true, Step: 1, Scalars: ScalarsMsg(optimizer.ScalarsFor(optimizer.Hyper{LR: 1, Beta1: 0.9, Beta2: 0.9}, 1))}})
	if !errors.Is(err, ErrServer) {
		t.Fatalf("step on an unknown tensor: %v, want ErrServer", err)
	}
	if _, err := c.Hello(); err != nil {
		t.Fatalf("hello after a refused request: %v", err)
	}
	if err := c.Call("no-such-op", nil, nil); !errors.Is(err, ErrServer) {
		t.Fatalf("unknown op: %v", err)
	}
}
