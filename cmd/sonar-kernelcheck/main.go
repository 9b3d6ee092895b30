// Command sonar-kernelcheck runs Sonar-MoE's CUDA AdamW kernels outside the server,
// for the GPU check (scripts/gpu-check): it needs a CUDA driver and NVRTC at
// run time, nothing at build time.
//
//	sonar-kernelcheck info            device, driver, NVRTC and kernel build, as JSON
//	sonar-kernelcheck files [-loads L] DIR
//	                            run the steps DIR/spec.json describes on the
//	                            tensors in DIR's files; write the kernel's and
//	                            the Go reference's results next to them
//	sonar-kernelcheck bench ...       kernel throughput on device buffers
//
// -loads is the kernels' memory access (scalar, sonard's default, or
// vector: optimizer/device.Loads). Every mode prints JSON on stdout; errors go to
// stderr with exit status 1.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/optimizer/device"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: sonar-kernelcheck info | files [-loads L] DIR | bench [-dtype D -numel N -iters K -fused -loads L|both]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "info":
		err = info()
	case "files":
		err = files(os.Args[2:])
	case "bench":
		err = bench(os.Args[2:])
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonar-kernelcheck:", err)
		os.Exit(1)
	}
}

// gpu is an opened device with the kernels loaded.
type gpu struct {
	dev *cuda.Device
	nv  *cuda.NVRTC
	eng *device.Engine // its kernels and stream; no tensor state is used
}

func openGPU(loads device.Loads) (*gpu, error) {
	dev, err := cuda.OpenDevice(0)
	if err != nil {
		return nil, err
	}
	nv, err := cuda.OpenNVRTC()
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	eng, err := device.NewEngine(dev, nv, loads)
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	return &gpu{dev: dev, nv: nv, eng: eng}, nil
}

func (g *gpu) close() {
	_ = g.eng.Close()
	_ = g.dev.Close()
}

// timed records start, runs launch n times on the stream, records end and
// returns the device milliseconds between the two records.
func (g *gpu) timed(start, end *cuda.Event, n int, launch func() error) (float32, error) {
	if err := start.Record(g.eng.Stream); err != nil {
		return 0, err
	}
	for i := 0; i < n; i++ {
		if err := launch(); err != nil {
			return 0, err
		}
	}
	if err := end.Record(g.eng.Stream); err != nil {
		return 0, err
	}
	if err := end.Sync(); err != nil {
		return 0, err
	}
	return end.Elapsed(start)
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func info() error {
	g, err := openGPU(device.ScalarLoads)
	if err != nil {
		return err
	}
	defer g.close()
	maj, mnr := g.nv.Version()
	free, total, err := g.dev.MemInfo()
	if err != nil {
		return err
	}
	return printJSON(map[string]any{
		"driver": g.dev.Driver().Path(), "driver_cuda": fmt.Sprintf("%d.%d", g.dev.Driver().Version()/1000, g.dev.Driver().Version()%1000/10),
		"device": g.dev.Name, "cc": fmt.Sprintf("%d.%d", g.dev.Major, g.dev.Minor), "sms": g.dev.SMs,
		"mem_total": total, "mem_free": free,
		"nvrtc": g.nv.Path(), "nvrtc_version": fmt.Sprintf("%d.%d", maj, mnr), "arch": fmt.Sprintf("compute_%d", g.eng.Kernels.Arch),
		"ptx_bytes": len(g.eng.Kernels.PTX), "options": device.CompileOptions(g.eng.Kernels.Arch, g.eng.Kernels.Loads),
	})
}

// ScalarsJSON are protocol Scalars as JSON (the same names as docs/protocol.md).
type ScalarsJSON struct {
	Decay       float64 `json:"decay"`
	ApplyDecay  bool    `json:"apply_decay"`
	Beta1W      float64 `json:"beta1_w"`
	Beta2       float64 `json:"beta2"`
	OneMinusB2  float64 `json:"one_minus_beta2"`
	NegStepSize float64 `json:"neg_step_size"`
	BC2Sqrt     float64 `json:"bc2_sqrt"`
	Eps         float64 `json:"eps"`
	Amsgrad     bool    `json:"amsgrad"`
	Maximize    bool    `json:"maximize"`
	// Fused runs torch's fused CUDA arithmetic (the sonar_fused_adamw
	// kernels) from LR, Beta1, WeightDecay, Beta2, Eps and Step (the step
	// count after the update; 0: the step's index + 1). BC1 and BC2, when
	// not 0, are the bias corrections 1 - powf(beta, step) as torch's CUDA
	// powf computes them, for the Go reference (which otherwise uses a
	// correctly rounded powf); the kernel computes its own.
	Fused       bool    `json:"fused,omitempty"`
	LR          float64 `json:"lr,omitempty"`
	Beta1       float64 `json:"beta1,omitempty"`
	WeightDecay float64 `json:"weight_decay,omitempty"`
	Step        int64   `json:"step,omitempty"`
	BC1         float64 `json:"bc1,omitempty"`
	BC2         float64 `json:"bc2,omitempty"`
	// FusedDouble (with Fused): torch 2.8-2.10's fused arithmetic (the
	// sonar_fused64 kernels); BC1 and BC2 are then the double bias
	// corrections.
	FusedDouble bool `json:"fused_double,omitempty"`
}

func (s ScalarsJSON) scalars() optimizer.Scalars {
	return optimizer.Scalars{Decay: s.Decay, ApplyDecay: s.ApplyDecay, Beta1W: s.Beta1W, Beta2: s.Beta2,
		OneMinusB2: s.OneMinusB2, NegStepSize: s.NegStepSize, BC2Sqrt: s.BC2Sqrt, Eps: s.Eps,
		Amsgrad: s.Amsgrad, Maximize: s.Maximize, Fused: s.Fused, LR: s.LR, Beta1: s.Beta1, WeightDecay: s.WeightDecay,
		FusedDouble: s.FusedDouble}
}

// reference applies the Go reference of the arithmetic sc selects to host buffers.
func (s ScalarsJSON) reference(dt optimizer.DType, step int64, p, g, m, v, vmax []byte) error {
	sc := s.scalars()
	if !s.Fused {
		return optimizer.ForeachStep(dt, p, g, m, v, vmax, sc)
	}
	if s.FusedDouble {
		k := optimizer.FusedCUDA64Of(sc, step)
		if s.BC1 != 0 {
			k.BC1 = s.BC1
		}
		if s.BC2 != 0 {
			k.BC2 = s.BC2
		}
		return optimizer.FusedCUDA64Step(dt, p, g, m, v, vmax, k)
	}
	k := optimizer.FusedCUDAOf(sc, step)
	if s.BC1 != 0 {
		k.BC1 = float32(s.BC1)
	}
	if s.BC2 != 0 {
		k.BC2 = float32(s.BC2)
	}
	return optimizer.FusedCUDAStep(dt, p, g, m, v, vmax, k)
}

// Spec is DIR/spec.json for "files": Steps steps of AdamW on the tensors;
// Scalars[s][i] are step s's scalars of tensor i. Inputs are DIR/t<i>_p.bin,
// _m.bin, _v.bin, _vmax.bin (amsgrad) and _g<s>.bin (raw little-endian
// values of the dtype); outputs DIR/t<i>_<p|m|v|vmax>.gpu.bin (kernel) and
// .ref.bin (optimizer.ForeachStep, or optimizer.FusedCUDAStep for fused
// scalars).
type Spec struct {
	DType   string          `json:"dtype"`
	Steps   int             `json:"steps"`
	Tensors []SpecTensor    `json:"tensors"`
	Scalars [][]ScalarsJSON `json:"scalars"`
}

// SpecTensor is one tensor of a Spec.
type SpecTensor struct {
	Numel   int64 `json:"numel"`
	Amsgrad bool  `json:"amsgrad"`
}

func readSpec(dir string) (Spec, optimizer.DType, error) {
	var sp Spec
	b, err := os.ReadFile(filepath.Join(dir, "spec.json"))
	if err != nil {
		return sp, 0, err
	}
	if err := json.Unmarshal(b, &sp); err != nil {
		return sp, 0, fmt.Errorf("spec.json: %w", err)
	}
	dt, err := optimizer.ParseDType(sp.DType)
	if err != nil {
		return sp, 0, fmt.Errorf("spec.json: %w", err)
	}
	if sp.Steps < 1 || len(sp.Scalars) != sp.Steps || len(sp.Tensors) == 0 {
		return sp, 0, fmt.Errorf("spec.json: %d steps, %d scalar sets, %d tensors", sp.Steps, len(sp.Scalars), len(sp.Tensors))
	}
	for s, row := range sp.Scalars {
		if len(row) != len(sp.Tensors) {
			return sp, 0, fmt.Errorf("spec.json: step %d has scalars for %d of %d tensors", s, len(row), len(sp.Tensors))
		}
		for i, sc := range row {
			if sc.Amsgrad != sp.Tensors[i].Amsgrad {
				return sp, 0, fmt.Errorf("spec.json: step %d tensor %d: amsgrad differs from the tensor's", s, i)
			}
		}
	}
	for i, t := range sp.Tensors {
		if t.Numel <= 0 {
			return sp, 0, fmt.Errorf("spec.json: tensor %d: numel %d", i, t.Numel)
		}
	}
	return sp, dt, nil
}

func readExact(path string, n int64) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if int64(len(b)) != n {
		return nil, fmt.Errorf("%s is %d bytes, want %d", path, len(b), n)
	}
	return b, nil
}

// hostTensor is one tensor's host copies (for the reference) and device buffers.
type hostTensor struct {
	nb      int64
	host    map[string][]byte // p, m, v, vmax: the reference's state
	dev     map[string]cuda.DevicePtr
	grad    cuda.DevicePtr // the allocation
	gradAt  cuda.DevicePtr // where the gradient starts in it
	amsgrad bool
}

// misaligned says whether tensor i's gradient is placed one element past a
// 16-byte boundary, so that the kernels' one-element path runs on a whole
// tensor too (every third tensor).
func misaligned(i int) bool { return i%3 == 2 }

func files(args []string) error {
	fs := flag.NewFlagSet("files", flag.ContinueOnError)
	loadsName := fs.String("loads", "scalar", "the kernels' memory access: scalar or vector")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("usage: sonar-kernelcheck files [-loads L] DIR")
	}
	dir := fs.Arg(0)
	loads, err := device.ParseLoads(*loadsName)
	if err != nil {
		return err
	}
	sp, dt, err := readSpec(dir)
	if err != nil {
		return err
	}
	g, err := openGPU(loads)
	if err != nil {
		return err
	}
	defer g.close()
	s := g.eng.Stream
	parts := []string{"p", "m", "v", "vmax"}
	ts := make([]*hostTensor, len(sp.Tensors))
	defer func() {
		for _, t := range ts {
			if t == nil {
				continue
			}
			for _, p := range t.dev {
				_ = g.dev.Free(p)
			}
			_ = g.dev.Free(t.grad)
		}
	}()
	for i, st := range sp.Tensors {
		t := &hostTensor{nb: st.Numel * int64(dt.Size()), host: map[string][]byte{}, dev: map[string]cuda.DevicePtr{}, amsgrad: st.Amsgrad}
		ts[i] = t
		for _, p := range parts {
			if p == "vmax" && !st.Amsgrad {
				continue
			}
			b, err := readExact(filepath.Join(dir, fmt.Sprintf("t%d_%s.bin", i, p)), t.nb)
			if err != nil {
				return err
			}
			t.host[p] = b
			if t.dev[p], err = g.dev.Alloc(t.nb); err != nil {
				return err
			}
			if err := g.dev.CopyHtoD(t.dev[p], b); err != nil {
				return err
			}
		}
		if t.grad, err = g.dev.Alloc(t.nb + 16); err != nil {
			return err
		}
		t.gradAt = t.grad
		if misaligned(i) {
			t.gradAt += cuda.DevicePtr(dt.Size())
		}
	}
	start, err := g.dev.NewEvent(cuda.EventTiming)
	if err != nil {
		return err
	}
	end, err := g.dev.NewEvent(cuda.EventTiming)
	if err != nil {
		return err
	}
	var kernelMs []float32
	for step := 0; step < sp.Steps; step++ {
		items := make([]device.Launch, len(ts))
		for i, t := range ts {
			gb, err := readExact(filepath.Join(dir, fmt.Sprintf("t%d_g%d.bin", i, step)), t.nb)
			if err != nil {
				return err
			}
			if err := g.dev.CopyHtoD(t.gradAt, gb); err != nil {
				return err
			}
			sj := sp.Scalars[step][i]
			count := sj.Step
			if count == 0 {
				count = int64(step + 1)
			}
			items[i] = device.Launch{Param: t.dev["p"], Grad: t.gradAt, ExpAvg: t.dev["m"], ExpAvgSq: t.dev["v"],
				MaxExpAvgSq: t.dev["vmax"], Numel: sp.Tensors[i].Numel, Scalars: sj.scalars(), Step: count}
			if err := sj.reference(dt, count, t.host["p"], gb, t.host["m"], t.host["v"], t.host["vmax"]); err != nil {
				return err
			}
		}
		// One launch list per arithmetic (foreach, fused, fused double).
		var lists [3][]device.Launch
		for _, it := range items {
			k := 0
			switch {
			case it.Scalars.Fused && it.Scalars.FusedDouble:
				k = 2
			case it.Scalars.Fused:
				k = 1
			}
			lists[k] = append(lists[k], it)
		}
		ms, err := g.timed(start, end, 1, func() error {
			for _, l := range lists {
				if len(l) > 0 {
					if err := g.eng.Kernels.AdamW(s, dt, l); err != nil {
						return err
					}
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		kernelMs = append(kernelMs, ms)
	}
	for i, t := range ts {
		for p, dp := range t.dev {
			out := make([]byte, t.nb)
			if err := g.dev.CopyDtoH(out, dp); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("t%d_%s.gpu.bin", i, p)), out, 0o644); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("t%d_%s.ref.bin", i, p)), t.host[p], 0o644); err != nil {
				return err
			}
		}
	}
	return printJSON(map[string]any{"ok": true, "dtype": dt.String(), "tensors": len(ts), "steps": sp.Steps,
		"kernel_ms": kernelMs, "arch": g.eng.Kernels.Arch, "loads": loads.String()})
}

// bench times the AdamW kernel on device buffers of numel elements, split in
// tensors tensors (launches of one batch), and reports bytes moved per second.
// With -loads both, the vector and the scalar kernels are timed in
// alternating rounds on the same buffers (medians of the rounds); the top
// level of the report is the first build's (vector).
func bench(args []string) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	dtName := fs.String("dtype", "bfloat16", "float32 or bfloat16")
	fused := fs.Bool("fused", false, "time the fused kernel (AdamW(fused=True)) instead of the foreach one")
	fusedDouble := fs.Bool("fused-double", false, "with -fused: torch 2.8-2.10's fused kernel")
	numel := fs.Int64("numel", 1<<28, "elements in all")
	tensors := fs.Int("tensors", 2, "tensors the elements are split into")
	iters := fs.Int("iters", 20, "timed launches per round")
	rounds := fs.Int("rounds", 3, "rounds (each times every kernel build once)")
	loadsName := fs.String("loads", "both", "the kernels' memory access: vector, scalar or both")
	if err := fs.Parse(args); err != nil {
		return err
	}
	dt, err := optimizer.ParseDType(*dtName)
	if err != nil {
		return err
	}
	var builds []device.Loads
	if *loadsName == "both" {
		builds = []device.Loads{device.VectorLoads, device.ScalarLoads}
	} else {
		l, err := device.ParseLoads(*loadsName)
		if err != nil {
			return err
		}
		builds = []device.Loads{l}
	}
	g, err := openGPU(builds[0])
	if err != nil {
		return err
	}
	defer g.close()
	kernels := []*device.Kernels{g.eng.Kernels}
	for _, l := range builds[1:] {
		k, err := device.LoadKernels(g.dev, g.nv, l)
		if err != nil {
			return err
		}
		defer k.Close() //nolint:errcheck
		kernels = append(kernels, k)
	}
	s := g.eng.Stream
	per := *numel / int64(*tensors)
	nb := per * int64(dt.Size())
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	sc := optimizer.ScalarsFor(h, 1)
	if *fused {
		sc.Fused, sc.LR, sc.Beta1, sc.WeightDecay, sc.FusedDouble = true, h.LR, h.Beta1, h.WeightDecay, *fusedDouble
	}
	var items []device.Launch
	var bufs []cuda.DevicePtr
	defer func() {
		for _, b := range bufs {
			_ = g.dev.Free(b)
		}
	}()
	for i := 0; i < *tensors; i++ {
		var p [4]cuda.DevicePtr
		for j := range p {
			if p[j], err = g.dev.Alloc(nb); err != nil {
				return err
			}
			bufs = append(bufs, p[j])
			if err := s.Zero(p[j], nb); err != nil {
				return err
			}
		}
		items = append(items, device.Launch{Param: p[0], Grad: p[1], ExpAvg: p[2], ExpAvgSq: p[3], Numel: per, Scalars: sc, Step: 1})
	}
	start, _ := g.dev.NewEvent(cuda.EventTiming)
	end, _ := g.dev.NewEvent(cuda.EventTiming)
	moved := float64(per*int64(*tensors)) * float64(7*dt.Size()) // read p g m v, write p m v
	times := make([][]float64, len(kernels))
	t0 := time.Now()
	for r := 0; r < max(*rounds, 1); r++ {
		for i, k := range kernels {
			if err := k.AdamW(s, dt, items); err != nil { // warm-up
				return err
			}
			ms, err := g.timed(start, end, *iters, func() error { return k.AdamW(s, dt, items) })
			if err != nil {
				return err
			}
			times[i] = append(times[i], float64(ms)/float64(*iters))
		}
	}
	host := time.Since(t0).Seconds() * 1e3 / float64(len(kernels)*max(*rounds, 1)*(*iters+1))
	byLoads := map[string]any{}
	for i, l := range builds {
		ms := median(times[i])
		byLoads[l.String()] = map[string]any{"ms_per_step": ms, "gbytes_per_s": moved / ms / 1e6, "rounds_ms": times[i]}
	}
	top := byLoads[builds[0].String()].(map[string]any)
	return printJSON(map[string]any{"dtype": dt.String(), "fused": *fused, "numel": per * int64(*tensors), "tensors": *tensors,
		"ms_per_step": top["ms_per_step"], "gbytes_per_s": top["gbytes_per_s"], "loads": builds[0].String(),
		"by_loads": byLoads, "host_ms": host})
}

// median of xs (not empty).
func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
