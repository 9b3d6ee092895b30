// Command sonar-bench measures the Go AdamW engine in-process: one
// optimizer.Engine.Apply over a whole tensor, for float32 and bfloat16, with
// the IEEE square root and (float32, with -torch-lib) torch's MKL vmsSqrt,
// next to the machine's copy bandwidth measured in the same run. It prints
// one JSON document; bench/run.py turns it into docs/benchmarks.md.
//
//	sonar-bench -sizes 1M,16M,64M -dtypes float32,bfloat16 -reps 7 -fused -torch-lib .../libtorch_cpu.so
//	sonar-bench -isa avx2 -sizes 16M          # the AVX2 kernels on an AVX-512 CPU (before/after)
//	sonar-bench -echo ipc:///tmp/echo.sock   # a bare ZeroMQ echo: the transport's floor
//	sonar-bench -unix-echo /tmp/echo.unix    # a plain Unix socket echo: the machine's floor
//
// Timings are reported, never asserted: medians over -reps repeats after
// one untimed warm-up (which faults the pages in and fills the state).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/optimizer/vml"
)

// Result is one kernel measurement.
type Result struct {
	Impl       string    `json:"impl"` // "single" (torch's single-tensor arithmetic) or "fused"
	DType      string    `json:"dtype"`
	Numel      int       `json:"numel"`
	Sqrt       string    `json:"sqrt"`            // "ieee" or "mkl"
	Lanes      int       `json:"lanes,omitempty"` // fused: the vector width whose tail the kernel reproduces
	Workers    int       `json:"workers"`
	Chunks     int       `json:"chunks_per_worker"` // 0: the engine's default
	BytesPerEl int       `json:"bytes_per_element"`
	MedianS    float64   `json:"median_s"`
	MinS       float64   `json:"min_s"`
	TimesS     []float64 `json:"times_s"`
	ElemsPerS  float64   `json:"elements_per_s"`
	GBps       float64   `json:"gb_per_s"`
}

// Copy is the copy-bandwidth measurement (read+write bytes per second).
type Copy struct {
	Bytes   int       `json:"bytes"`
	Workers int       `json:"workers"`
	MedianS float64   `json:"median_s"`
	TimesS  []float64 `json:"times_s"`
	GBps    float64   `json:"gb_per_s_read_write"`
}

// Report is the whole output.
type Report struct {
	GoVersion  string   `json:"go_version"`
	GOMAXPROCS int      `json:"gomaxprocs"`
	NumCPU     int      `json:"num_cpu"`
	Reps       int      `json:"reps"`
	TorchLib   string   `json:"torch_lib,omitempty"`
	ISA        string   `json:"isa"`     // the kernels' vector instruction set (-isa, capped at the CPU's)
	CPUISA     string   `json:"cpu_isa"` // the CPU's widest
	Copy       []Copy   `json:"copy"`
	Stream     []Stream `json:"stream,omitempty"`
	Divider    *Divider `json:"divider,omitempty"`
	Kernels    []Result `json:"kernels"`
}

func main() {
	sizes := flag.String("sizes", "1M,16M,64M", "tensor sizes in elements (K/M suffixes), comma separated; empty: copy only")
	dtypes := flag.String("dtypes", "float32,bfloat16", "dtypes, comma separated")
	reps := flag.Int("reps", 7, "timed repeats per case (median reported)")
	workers := flag.Int("workers", runtime.NumCPU(), "engine workers (goroutines per tensor)")
	chunks := flag.Int("chunks", 0, "chunks per worker the engine cuts a tensor into (0: its default; 1: one fixed chunk each)")
	copyMB := flag.Int("copy-mb", 256, "size of the copy-bandwidth buffer in MiB (0: no copy measurement)")
	streamM := flag.Int("stream-m", 0, "also measure AdamW's streaming pattern over four arrays of this many Mi float32 elements (0: not)")
	torchLib := flag.String("torch-lib", "", "libtorch_cpu.so whose MKL vmsSqrt to measure as well (float32)")
	fused := flag.Bool("fused", false, "also measure the fused arithmetic (torch.optim.AdamW(fused=True))")
	divider := flag.Bool("divider", false, "also measure the divider's floor: one square root and two divisions an element on one core")
	isa := flag.String("isa", "", "cap the kernels' vector instruction set: avx512vbmi, avx512bf16, avx512, avx2 or go (default: the CPU's widest)")
	echoAddr := flag.String("echo", "", "serve a bare ZeroMQ ROUTER echo on this address until killed (no kernels)")
	unixEchoPath := flag.String("unix-echo", "", "serve a plain Unix seqpacket socket echo at this path until killed (no ZeroMQ)")
	flag.Parse()
	if *unixEchoPath != "" {
		if err := unixEcho(*unixEchoPath); err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench:", err)
			os.Exit(1)
		}
		return
	}
	if *echoAddr != "" {
		if err := echo(*echoAddr); err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench:", err)
			os.Exit(1)
		}
		return
	}

	if *isa != "" {
		l, err := optimizer.ParseISA(*isa)
		if err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench:", err)
			os.Exit(2)
		}
		optimizer.LimitISA(l)
	}
	ns, err := parseSizes(*sizes)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonar-bench:", err)
		os.Exit(2)
	}
	// The float32 square roots measured: IEEE; with -torch-lib, MKL's
	// vmsSqrt called, and the engine's emulation of it where it checks equal.
	sqrts := []namedSqrt{{name: "ieee"}}
	if *torchLib != "" {
		sq, err := vml.Load(*torchLib)
		if err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench:", err)
			os.Exit(1)
		}
		sqrts = append(sqrts, namedSqrt{optimizer.CallSqrt(sq.Apply), "mkl"})
		if emu, err := optimizer.FindMKLSqrt(sq.Apply, *workers); err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench: not measuring an MKL emulation:", err)
		} else {
			fmt.Fprintf(os.Stderr, "sonar-bench: MKL's vmsSqrt emulated as %v\n", emu)
			sqrts = append(sqrts, namedSqrt{emu, "mkl-emulated"})
		}
	}
	rep := Report{GoVersion: runtime.Version(), GOMAXPROCS: runtime.GOMAXPROCS(0), NumCPU: runtime.NumCPU(),
		Reps: *reps, TorchLib: *torchLib, ISA: optimizer.KernelISA().String(), CPUISA: optimizer.CPUISA().String()}
	if *copyMB > 0 {
		rep.Copy = append(rep.Copy, copyBandwidth(*copyMB<<20, *workers, *reps))
	}
	if *streamM > 0 {
		rep.Stream = append(rep.Stream, streamBandwidth(*streamM<<20, *workers, *reps))
	}
	if *divider {
		rep.Divider = dividerFloor(*reps)
	}
	for _, ds := range strings.Split(*dtypes, ",") {
		if len(ns) == 0 {
			break
		}
		d, err := optimizer.ParseDType(strings.TrimSpace(ds))
		if err != nil {
			fmt.Fprintln(os.Stderr, "sonar-bench:", err)
			os.Exit(2)
		}
		for _, n := range ns {
			for i, q := range sqrts {
				if i == 0 || d == optimizer.Float32 {
					rep.Kernels = append(rep.Kernels, kernel(d, n, *workers, *chunks, *reps, q, false))
				}
			}
			if *fused {
				rep.Kernels = append(rep.Kernels, kernel(d, n, *workers, *chunks, *reps, sqrts[0], true))
			}
			runtime.GC()
			debug.FreeOSMemory()
		}
	}
	// The copy again at the end: the machine's load may drift during the run.
	if *copyMB > 0 && len(ns) > 0 {
		rep.Copy = append(rep.Copy, copyBandwidth(*copyMB<<20, *workers, *reps))
	}
	if *streamM > 0 && len(ns) > 0 {
		rep.Stream = append(rep.Stream, streamBandwidth(*streamM<<20, *workers, *reps))
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(rep); err != nil {
		fmt.Fprintln(os.Stderr, "sonar-bench:", err)
		os.Exit(1)
	}
}

func parseSizes(s string) ([]int, error) {
	var out []int
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mult := 1
		switch {
		case strings.HasSuffix(f, "M"):
			mult, f = 1<<20, strings.TrimSuffix(f, "M")
		case strings.HasSuffix(f, "K"):
			mult, f = 1<<10, strings.TrimSuffix(f, "K")
		}
		v, err := strconv.Atoi(f)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("bad size %q", f)
		}
		out = append(out, v*mult)
	}
	return out, nil
}

// staggered returns n zeroed bytes starting at offset off mod 4 KiB, as the
// engine places its state and the client its gradient slots (parameters in
// shared memory sit at offset 0).
func staggered(n, off int) []byte {
	buf := make([]byte, n+8192)
	base := int(uintptr(unsafe.Pointer(&buf[0])) % 4096)
	start := (off - base + 8192) % 4096
	return buf[start : start+n : start+n]
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// parallel runs fn over [0, n) split into one contiguous chunk per worker.
func parallel(n, workers int, fn func(lo, hi int)) {
	chunk := (n + workers - 1) / workers
	chunk = (chunk + 4095) &^ 4095
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += chunk {
		hi := min(lo+chunk, n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}

func copyBandwidth(nb, workers, reps int) Copy {
	src, dst := staggered(nb, 0), staggered(nb, 512)
	for i := range src {
		src[i] = byte(i)
	}
	run := func() float64 {
		t := time.Now()
		parallel(nb, workers, func(lo, hi int) { copy(dst[lo:hi], src[lo:hi]) })
		return time.Since(t).Seconds()
	}
	run() // fault dst in
	c := Copy{Bytes: nb, Workers: workers}
	for range reps {
		c.TimesS = append(c.TimesS, run())
	}
	c.MedianS = median(c.TimesS)
	c.GBps = 2 * float64(nb) / c.MedianS / 1e9
	return c
}

// fusedLanes is the vector width of torch's fused CPU kernel on AVX2 and
// AVX-512 builds (see the client's fused_lanes): only the tensor's last
// numel % lanes elements take the scalar tail.
func fusedLanes(d optimizer.DType) int {
	if d == optimizer.BFloat16 {
		return 16
	}
	return 8
}

// namedSqrt is a square root to measure and its name in the report.
type namedSqrt struct {
	q    optimizer.Sqrt
	name string
}

func kernel(d optimizer.DType, n, workers, chunks, reps int, sq namedSqrt, fused bool) Result {
	r := rand.New(rand.NewPCG(1, uint64(n)))
	sz := d.Size()
	param := staggered(n*sz, 0)
	grad := staggered(n*sz, 512)
	fill := func(b []byte, scale float64) {
		switch d {
		case optimizer.Float32:
			f := optimizer.F32s(b)
			for i := range f {
				f[i] = float32(r.NormFloat64() * scale)
			}
		case optimizer.BFloat16:
			h := optimizer.U16s(b)
			for i := range h {
				h[i] = optimizer.F32ToBF16(float32(r.NormFloat64() * scale))
			}
		}
	}
	fill(param, 0.02)
	fill(grad, 0.01)
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	t, err := optimizer.NewTensor("bench", d, n, h, param)
	if err != nil {
		panic(err)
	}
	eng := optimizer.NewEngine()
	eng.Workers, eng.ChunksPerWorker = workers, chunks
	eng.Sqrt, eng.SqrtName = sq.q, sq.name
	name := sq.name
	step := func() float64 {
		s := optimizer.ScalarsFor(h, t.Step+1)
		if fused {
			s.Fused, s.Lanes = true, fusedLanes(d)
		}
		start := time.Now()
		if err := eng.Apply(t, grad, s); err != nil {
			panic(err)
		}
		return time.Since(start).Seconds()
	}
	step() // warm-up: faults the state in, step 1
	res := Result{Impl: "single", DType: d.String(), Numel: n, Sqrt: name, Workers: workers, Chunks: chunks, BytesPerEl: 7 * sz}
	if fused {
		res.Impl, res.Lanes = "fused", fusedLanes(d)
	}
	for range reps {
		res.TimesS = append(res.TimesS, step())
	}
	res.MedianS = median(res.TimesS)
	res.MinS = slices.Min(res.TimesS)
	res.ElemsPerS = float64(n) / res.MedianS
	res.GBps = res.ElemsPerS * float64(res.BytesPerEl) / 1e9
	return res
}
