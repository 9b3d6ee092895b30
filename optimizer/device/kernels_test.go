package device

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
)

func TestKernelSourceEmbedded(t *testing.T) {
	src := KernelSource()
	if len(src) < 1000 {
		t.Fatalf("embedded kernel source is %d bytes", len(src))
	}
	for _, want := range append([]string{"BEGIN LAYOUT", "END LAYOUT", "BEGIN MATH", "END MATH",
		fmt.Sprintf("#define SONAR_MAX_TENSORS %d", MaxBatchTensors), fmt.Sprintf("#define SONAR_CHUNK %d", ChunkElems),
		fmt.Sprintf("#define SONAR_THREADS %d", threadsPerBlock)}, kernelNames...) {
		if !strings.Contains(src, want) {
			t.Errorf("kernel source lacks %q", want)
		}
	}
}

// section returns the text between "// BEGIN name" and "// END name".
func section(t *testing.T, name string) string {
	t.Helper()
	src := KernelSource()
	i := strings.Index(src, "// BEGIN "+name)
	j := strings.Index(src, "// END "+name)
	if i < 0 || j < i {
		t.Fatalf("no %s section in the kernel source", name)
	}
	return src[i:j]
}

// hostBuild compiles a C++ program made of the given parts with the host
// compiler (skipping the test where there is none) and returns its path.
func hostBuild(t *testing.T, parts ...string) string {
	t.Helper()
	cxx, err := exec.LookPath("c++")
	if err != nil {
		t.Skip("no C++ compiler on this machine")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "h.cc")
	if err := os.WriteFile(src, []byte(strings.Join(parts, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "h")
	// -ffp-contract=off: the host build must not fuse what the kernel keeps apart.
	out, err := exec.Command(cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-o", bin, src, "-lm").CombinedOutput()
	if err != nil {
		t.Fatalf("compiling the host harness: %v\n%s", err, out)
	}
	return bin
}

const hostPrelude = "#include <stdio.h>\n#include <string.h>\n#include <math.h>\n#include <stddef.h>\n"

// TestLayoutMatchesC checks the Go offsets against the C compiler's layout
// of the structs in kernels/adamw.cu (x86-64 and the CUDA device ABI agree
// on these plain structs of 8- and 4-byte fields).
func TestLayoutMatchesC(t *testing.T) {
	bin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), `
int main() {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n",
    sizeof(SonarTensor), offsetof(SonarTensor, param), offsetof(SonarTensor, grad), offsetof(SonarTensor, exp_avg),
    offsetof(SonarTensor, exp_avg_sq), offsetof(SonarTensor, max_exp_avg_sq), offsetof(SonarTensor, numel),
    offsetof(SonarTensor, first_chunk), offsetof(SonarTensor, decay), offsetof(SonarTensor, beta1_w),
    offsetof(SonarTensor, beta2), offsetof(SonarTensor, one_minus_beta2), offsetof(SonarTensor, neg_step_size),
    offsetof(SonarTensor, bc2_sqrt), offsetof(SonarTensor, eps), offsetof(SonarTensor, flags),
    offsetof(SonarBatch, n), offsetof(SonarBatch, total_chunks), sizeof(SonarBatch));
  return 0;
}`)
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d", tensorDescSize, offParam, offGrad,
		offExpAvg, offExpAvgSq, offMaxExpAvgSq, offNumel, offFirstChunk, offDecay, offBeta1W, offBeta2, offOneMinusB2,
		offNegStepSize, offBC2Sqrt, offEps, offFlags, batchOffN, batchOffTotal, batchSize)
	if got := strings.TrimSpace(string(out)); got != want {
		t.Errorf("C layout %s\n Go layout %s", got, want)
	}
	fbin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), `
int main() {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(SonarFusedTensor),
    offsetof(SonarFusedTensor, param), offsetof(SonarFusedTensor, numel), offsetof(SonarFusedTensor, first_chunk),
    offsetof(SonarFusedTensor, lr), offsetof(SonarFusedTensor, beta1), offsetof(SonarFusedTensor, beta2),
    offsetof(SonarFusedTensor, weight_decay), offsetof(SonarFusedTensor, eps), offsetof(SonarFusedTensor, step),
    offsetof(SonarFusedTensor, flags), offsetof(SonarFusedBatch, n), offsetof(SonarFusedBatch, total_chunks), sizeof(SonarFusedBatch));
  return 0;
}`)
	fout, err := exec.Command(fbin).Output()
	if err != nil {
		t.Fatal(err)
	}
	fwant := fmt.Sprintf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d", tensorDescSize, offParam, offNumel, offFirstChunk,
		offFusedLR, offFusedBeta1, offFusedBeta2, offFusedWD, offFusedEps, offFusedStep, offFlags, batchOffN, batchOffTotal, batchSize)
	if got := strings.TrimSpace(string(fout)); got != fwant {
		t.Errorf("C layout of the fused batch %s\n Go layout %s", got, fwant)
	}
	dbin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), `
int main() {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(SonarFused64Tensor),
    offsetof(SonarFused64Tensor, numel), offsetof(SonarFused64Tensor, lr), offsetof(SonarFused64Tensor, beta1),
    offsetof(SonarFused64Tensor, beta2), offsetof(SonarFused64Tensor, weight_decay), offsetof(SonarFused64Tensor, eps),
    offsetof(SonarFused64Tensor, step), offsetof(SonarFused64Tensor, flags), offsetof(SonarFused64Batch, n),
    offsetof(SonarFused64Batch, total_chunks), sizeof(SonarFused64Batch));
  return 0;
}`)
	dout, err := exec.Command(dbin).Output()
	if err != nil {
		t.Fatal(err)
	}
	dwant := fmt.Sprintf("%d %d %d %d %d %d %d %d %d %d %d %d", fused64DescSize, offNumel, off64LR, off64Beta1, off64Beta2,
		off64WD, off64Eps, off64Step, off64Flags, batch64OffN, batch64OffTotal, batch64Size)
	if got := strings.TrimSpace(string(dout)); got != dwant {
		t.Errorf("C layout of the fused double batch %s\n Go layout %s", got, dwant)
	}
	if batch64Size > maxKernelParams {
		t.Errorf("SonarFused64Batch is %d bytes, over the %d-byte kernel parameter limit", batch64Size, maxKernelParams)
	}
	if batchSize > maxKernelParams {
		t.Errorf("SonarBatch is %d bytes, over the %d-byte kernel parameter limit", batchSize, maxKernelParams)
	}
}

// mathHarness reads records of (bf16 flag, 7 scalars, flags, p, g, m, v,
// vmax) and writes (p, m, v, vmax, acc) as the kernel's element functions
// compute them.
const mathHarness = `
int main() {
  unsigned int hdr[2]; float in[12];
  while (fread(hdr, 4, 2, stdin) == 2 && fread(in, 4, 12, stdin) == 12) {
    SonarTensor t; memset(&t, 0, sizeof t);
    t.decay = in[0]; t.beta1_w = in[1]; t.beta2 = in[2]; t.one_minus_beta2 = in[3];
    t.neg_step_size = in[4]; t.bc2_sqrt = in[5]; t.eps = in[6]; t.flags = hdr[1];
    float p = in[7], g = in[8], m = in[9], v = in[10], vm = in[11], acc;
    if (hdr[0]) { sonar_adamw_element<SonarBF16>(p, g, m, v, vm, t); acc = sonar_add_element<SonarBF16>(in[7], in[8]); }
    else { sonar_adamw_element<SonarF32>(p, g, m, v, vm, t); acc = sonar_add_element<SonarF32>(in[7], in[8]); }
    float out[5] = {p, m, v, vm, acc};
    fwrite(out, 4, 5, stdout);
  }
  return 0;
}`

type mathCase struct {
	bf16  bool
	k     optimizer.Scalars
	p, g  float32
	m, v  float32
	vmax  float32
	label string
}

func roundBF16(f float32) float32 { return optimizer.BF16ToF32(optimizer.ForeachBF16(f)) }

// foreachOne is optimizer's foreach reference on one element.
func foreachOne(c mathCase) [4]float32 {
	if c.bf16 {
		b := optimizer.ForeachBF16
		p, g, m, v, vm := []uint16{b(c.p)}, []uint16{b(c.g)}, []uint16{b(c.m)}, []uint16{b(c.v)}, []uint16{b(c.vmax)}
		optimizer.ForeachStepBF16(p, g, m, v, vm, c.k)
		f := optimizer.BF16ToF32
		return [4]float32{f(p[0]), f(m[0]), f(v[0]), f(vm[0])}
	}
	p, g, m, v, vm := []float32{c.p}, []float32{c.g}, []float32{c.m}, []float32{c.v}, []float32{c.vmax}
	optimizer.ForeachStepF32(p, g, m, v, vm, c.k)
	return [4]float32{p[0], m[0], v[0], vm[0]}
}

// TestHostMathMatchesRef runs the kernel's element arithmetic (compiled for
// the host, with C's correctly rounded fmaf, sqrtf and division standing in
// for __fmaf_rn, __fsqrt_rn and __fdiv_rn) against optimizer.ForeachStep's,
// bit for bit, on random and edge-case inputs. It proves the CUDA C and the
// Go reference say the same thing; the GPU check then compares both with
// torch.
func TestHostMathMatchesRef(t *testing.T) {
	bin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), mathHarness)
	r := rand.New(rand.NewPCG(7, 11))
	var cases []mathCase
	base := optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}, 3)
	variants := []struct {
		label string
		mod   func(k *optimizer.Scalars)
	}{
		{"default", func(k *optimizer.Scalars) {}},
		{"amsgrad", func(k *optimizer.Scalars) { k.Amsgrad = true }},
		{"maximize", func(k *optimizer.Scalars) { k.Maximize = true }},
		{"no-decay", func(k *optimizer.Scalars) { k.ApplyDecay = false }},
		{"big-lerp-weight", func(k *optimizer.Scalars) { k.Beta1W = 0.75 }},
		{"beta2=0 (addcmul value 1)", func(k *optimizer.Scalars) { k.Beta2, k.OneMinusB2 = 0, 1 }},
		{"addcdiv value 1", func(k *optimizer.Scalars) { k.NegStepSize = 1 }},
		{"step 1000", func(k *optimizer.Scalars) {
			*k = optimizer.ScalarsFor(optimizer.Hyper{LR: 3e-4, Beta1: 0.9, Beta2: 0.95, Eps: 1e-6, WeightDecay: 0.1}, 1000)
		}},
	}
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-40, -1e-40, 1, -1, 3e38, float32(math.Inf(1)), float32(math.NaN())}
	for _, bf := range []bool{false, true} {
		for _, vr := range variants {
			k := base
			vr.mod(&k)
			for i := 0; i < 3000; i++ {
				c := mathCase{bf16: bf, k: k, label: vr.label,
					p: float32(r.NormFloat64() * 0.05), g: float32(r.NormFloat64() * math.Pow(10, -4+4*r.Float64())),
					m: float32(r.NormFloat64() * 1e-3), v: float32(r.Float64() * 1e-5), vmax: float32(r.Float64() * 1e-5)}
				if i < 40 { // edge values in each slot
					s := special[i%len(special)]
					switch i / len(special) {
					case 0:
						c.g = s
					case 1:
						c.v = float32(math.Abs(float64(s)))
					case 2:
						c.p = s
					case 3:
						c.m = s
					}
				}
				if bf {
					c.p, c.g, c.m, c.v, c.vmax = roundBF16(c.p), roundBF16(c.g), roundBF16(c.m), roundBF16(c.v), roundBF16(c.vmax)
				}
				cases = append(cases, c)
			}
		}
	}
	var in bytes.Buffer
	le := binary.LittleEndian
	for _, c := range cases {
		var bf uint32
		if c.bf16 {
			bf = 1
		}
		for _, u := range []uint32{bf, scalarFlags(c.k)} {
			_ = binary.Write(&in, le, u)
		}
		k := c.k
		for _, f := range []float32{float32(k.Decay), float32(k.Beta1W), float32(k.Beta2), float32(k.OneMinusB2),
			float32(k.NegStepSize), float32(k.BC2Sqrt), float32(k.Eps), c.p, c.g, c.m, c.v, c.vmax} {
			_ = binary.Write(&in, le, math.Float32bits(f))
		}
	}
	cmd := exec.Command(bin)
	cmd.Stdin = &in
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(cases)*20 {
		t.Fatalf("harness wrote %d bytes for %d cases", len(out), len(cases))
	}
	bad := 0
	for i, c := range cases {
		ref := foreachOne(c)
		acc := c.p + c.g
		if c.bf16 {
			acc = roundBF16(acc)
		}
		want := []float32{ref[0], ref[1], ref[2], ref[3], acc}
		for j, w := range want {
			got := math.Float32frombits(le.Uint32(out[20*i+4*j:]))
			same := math.Float32bits(got) == math.Float32bits(w) || (got != got && w != w) // NaN payloads: host C vs device differ
			if !c.k.Amsgrad && j == 3 {
				same = true
			}
			if !same {
				bad++
				if bad <= 10 {
					t.Errorf("%s bf16=%v case %d output %d: kernel math %v (%#08x), Go reference %v (%#08x); in p=%v g=%v m=%v v=%v",
						c.label, c.bf16, i, j, got, math.Float32bits(got), w, math.Float32bits(w), c.p, c.g, c.m, c.v)
				}
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d outputs differ", bad, 5*len(cases))
	}
}

func TestPackBatch(t *testing.T) {
	sc := optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}, 2)
	ams := sc
	ams.Amsgrad = true
	item := func(numel int64, s optimizer.Scalars) Launch {
		return Launch{Param: 0x1000, Grad: 0x2000, ExpAvg: 0x3000, ExpAvgSq: 0x4000, MaxExpAvgSq: 0x5000, Numel: numel, Scalars: s}
	}
	tests := []struct {
		name   string
		items  []Launch
		chunks uint64
		err    string
	}{
		{"one small", []Launch{item(10, sc)}, 1, ""},
		{"exact chunk", []Launch{item(ChunkElems, sc)}, 1, ""},
		{"chunk plus one", []Launch{item(ChunkElems+1, sc)}, 2, ""},
		{"several", []Launch{item(3*ChunkElems, sc), item(1, ams), item(2*ChunkElems-1, sc)}, 6, ""},
		{"empty", nil, 0, "batch of 0"},
		{"too many", make([]Launch, MaxBatchTensors+1), 0, "batch of 45"},
		{"zero numel", []Launch{item(0, sc)}, 0, "numel 0"},
		{"null pointer", []Launch{{Grad: 1, ExpAvg: 1, ExpAvgSq: 1, Numel: 1}}, 0, "null device pointer"},
		{"amsgrad without vmax", []Launch{{Param: 1, Grad: 1, ExpAvg: 1, ExpAvgSq: 1, Numel: 1, Scalars: ams}}, 0, "amsgrad"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, chunks, err := PackBatch(tc.items)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != batchSize || chunks != tc.chunks {
				t.Fatalf("len %d chunks %d, want %d %d", len(b), chunks, batchSize, tc.chunks)
			}
			le := binary.LittleEndian
			if n := le.Uint32(b[batchOffN:]); int(n) != len(tc.items) {
				t.Errorf("n = %d", n)
			}
			if tot := le.Uint64(b[batchOffTotal:]); tot != tc.chunks {
				t.Errorf("total_chunks = %d", tot)
			}
			var first uint64
			for i, it := range tc.items {
				d := b[i*tensorDescSize:]
				if cuda.DevicePtr(le.Uint64(d[offParam:])) != it.Param || cuda.DevicePtr(le.Uint64(d[offGrad:])) != it.Grad ||
					cuda.DevicePtr(le.Uint64(d[offExpAvg:])) != it.ExpAvg || cuda.DevicePtr(le.Uint64(d[offExpAvgSq:])) != it.ExpAvgSq {
					t.Errorf("tensor %d: pointers wrong", i)
				}
				vm := le.Uint64(d[offMaxExpAvgSq:])
				if it.Scalars.Amsgrad != (vm != 0) {
					t.Errorf("tensor %d: max_exp_avg_sq %#x with amsgrad=%v", i, vm, it.Scalars.Amsgrad)
				}
				if fc := le.Uint64(d[offFirstChunk:]); fc != first {
					t.Errorf("tensor %d: first_chunk %d, want %d", i, fc, first)
				}
				first += uint64((it.Numel + ChunkElems - 1) / ChunkElems)
				if got := math.Float32frombits(le.Uint32(d[offNegStepSize:])); got != float32(it.Scalars.NegStepSize) {
					t.Errorf("tensor %d: neg_step_size %v", i, got)
				}
				if got := math.Float32frombits(le.Uint32(d[offEps:])); got != float32(it.Scalars.Eps) {
					t.Errorf("tensor %d: eps %v", i, got)
				}
				if f := le.Uint32(d[offFlags:]); f != scalarFlags(it.Scalars) || f&flagDecay == 0 {
					t.Errorf("tensor %d: flags %#x", i, f)
				}
			}
		})
	}
}

// TestPackFusedBatch checks the fused descriptors: the hyper-parameters
// and step as floats, decay decided by the float weight decay (as torch's
// kernel tests it), and batches that mix the two arithmetics refused.
func TestPackFusedBatch(t *testing.T) {
	sc := optimizer.Scalars{Fused: true, LR: 3e-4, Beta1: 0.9, Beta2: 0.95, WeightDecay: 0.1, Eps: 1e-6, ApplyDecay: true, Maximize: true}
	tiny := sc
	tiny.WeightDecay = 1e-50 // not 0 in double, 0 in float: torch's kernel does not decay
	it := func(s optimizer.Scalars, step int64) Launch {
		return Launch{Param: 0x1000, Grad: 0x2000, ExpAvg: 0x3000, ExpAvgSq: 0x4000, Numel: 5, Scalars: s, Step: step}
	}
	b, chunks, err := PackBatch([]Launch{it(sc, 7), it(tiny, 1)})
	if err != nil || chunks != 2 {
		t.Fatalf("PackBatch: %v (%d chunks)", err, chunks)
	}
	le := binary.LittleEndian
	f := func(d []byte, off int) float32 { return math.Float32frombits(le.Uint32(d[off:])) }
	d := b[:tensorDescSize]
	if f(d, offFusedLR) != float32(3e-4) || f(d, offFusedBeta1) != 0.9 || f(d, offFusedBeta2) != 0.95 ||
		f(d, offFusedWD) != float32(0.1) || f(d, offFusedEps) != float32(1e-6) || f(d, offFusedStep) != 7 {
		t.Errorf("fused descriptor floats %v %v %v %v %v %v", f(d, offFusedLR), f(d, offFusedBeta1), f(d, offFusedBeta2),
			f(d, offFusedWD), f(d, offFusedEps), f(d, offFusedStep))
	}
	if fl := le.Uint32(d[offFlags:]); fl != flagDecay|flagMaximize {
		t.Errorf("flags %#x", fl)
	}
	if fl := le.Uint32(b[tensorDescSize+offFlags:]); fl != flagMaximize {
		t.Errorf("weight decay 1e-50 (0 in float): flags %#x, want no decay", fl)
	}
	foreach := sc
	foreach.Fused = false
	if _, _, err := PackBatch([]Launch{it(sc, 1), it(foreach, 1)}); err == nil || !strings.Contains(err.Error(), "fused and foreach") {
		t.Errorf("mixed batch: %v", err)
	}
	if _, _, err := PackBatch([]Launch{it(sc, 0)}); err == nil || !strings.Contains(err.Error(), "step count 0") {
		t.Errorf("step 0: %v", err)
	}

	// torch 2.8-2.10's arithmetic: the doubles themselves, decay when the double is not 0.
	d64, d64t := sc, tiny
	d64.FusedDouble, d64t.FusedDouble = true, true
	b, chunks, err = PackBatch([]Launch{it(d64, 7), it(d64t, 1)})
	if err != nil || chunks != 2 || len(b) != batch64Size {
		t.Fatalf("PackBatch fused double: %v (%d chunks, %d bytes)", err, chunks, len(b))
	}
	g := func(d []byte, off int) float64 { return math.Float64frombits(le.Uint64(d[off:])) }
	d = b[:fused64DescSize]
	if g(d, off64LR) != 3e-4 || g(d, off64Beta1) != 0.9 || g(d, off64Beta2) != 0.95 || g(d, off64WD) != 0.1 ||
		g(d, off64Eps) != 1e-6 || f(d, off64Step) != 7 || le.Uint32(d[off64Flags:]) != flagDecay|flagMaximize {
		t.Errorf("fused double descriptor %v %v %v %v %v %v %#x", g(d, off64LR), g(d, off64Beta1), g(d, off64Beta2),
			g(d, off64WD), g(d, off64Eps), f(d, off64Step), le.Uint32(d[off64Flags:]))
	}
	if fl := le.Uint32(b[fused64DescSize+off64Flags:]); fl != flagDecay|flagMaximize {
		t.Errorf("weight decay 1e-50 in double: flags %#x, want decay", fl)
	}
	if le.Uint32(b[batch64OffN:]) != 2 || le.Uint64(b[batch64OffTotal:]) != 2 {
		t.Error("fused double batch header")
	}
	if _, _, err := PackBatch([]Launch{it(d64, 1), it(sc, 1)}); err == nil || !strings.Contains(err.Error(), "one batch") {
		t.Errorf("fused double and fused in one batch: %v", err)
	}
	many := make([]Launch, MaxFused64Tensors+1)
	for i := range many {
		many[i] = it(d64, 1)
	}
	if _, _, err := PackBatch(many); err == nil || !strings.Contains(err.Error(), "batch of 40") {
		t.Errorf("40 fused double tensors in one batch: %v", err)
	}
}

func TestGridFor(t *testing.T) {
	for _, tc := range []struct {
		chunks uint64
		sms    int
		want   uint32
	}{{1, 132, 1}, {100, 132, 100}, {5000, 132, 1056}, {5000, 0, 8}} {
		if got := gridFor(tc.chunks, tc.sms); got != tc.want {
			t.Errorf("gridFor(%d, %d) = %d, want %d", tc.chunks, tc.sms, got, tc.want)
		}
	}
}

// TestCompileKernels compiles the embedded kernels with a real NVRTC (no GPU
// needed), with vector and with scalar loads, and checks the PTX: every
// entry point is there, the float arithmetic is the IEEE kind the source
// asks for, the 4 KB batch parameter is not copied to local memory, and
// the vector build moves 16 bytes per access where the scalar one does not.
func TestCompileKernels(t *testing.T) {
	nv := testNVRTC(t)
	maj, mnr := nv.Version()
	t.Logf("NVRTC %d.%d from %s, archs %v", maj, mnr, nv.Path(), nv.SupportedArchs())
	for _, arch := range []int{90, 80, 75} {
		if a, err := nv.PickArch(arch/10, arch%10); err != nil || a != arch {
			t.Logf("sm_%d not supported by this NVRTC (%d, %v)", arch, a, err)
			continue
		}
		for _, loads := range []Loads{VectorLoads, ScalarLoads} {
			checkPTX(t, nv, arch, loads)
		}
	}
}

// checkPTX compiles the kernels for compute_<arch> with the given loads and
// checks the PTX.
func checkPTX(t *testing.T, nv *cuda.NVRTC, arch int, loads Loads) {
	t.Helper()
	ptx, err := CompileKernels(nv, arch, loads)
	if err != nil {
		t.Fatalf("compute_%d: %v", arch, err)
	}
	s := string(ptx)
	for _, k := range kernelNames {
		if !strings.Contains(s, ".entry "+k+"(") {
			t.Errorf("compute_%d: no entry %s", arch, k)
		}
	}
	// CUDA's powf and pow (sonar_powf, sonar_pow64 and libdevice's
	// __internal_accurate_pow: the fused kernels' bias corrections, as
	// torch's) seed their logarithm with an approximate reciprocal; nothing
	// else may approximate, flush or contract.
	funcs := ptxFunctions(s)
	for _, f := range []string{"sonar_powf", "sonar_pow64"} {
		if _, ok := funcs[f]; !ok {
			t.Errorf("compute_%d: no out-of-line %s", arch, f)
		}
	}
	for name, body := range funcs {
		if name == "sonar_powf" || name == "sonar_pow64" || name == "__internal_accurate_pow" { // CUDA's pow
			continue
		}
		for _, bad := range []string{"div.approx", "sqrt.approx", ".ftz.", "rcp.approx", "mad.f32"} {
			if strings.Contains(body, bad) {
				t.Errorf("compute_%d: %s has %q: not IEEE float arithmetic", arch, name, bad)
			}
		}
	}
	for k, f := range map[string]string{"sonar_fused_adamw_f32": "sonar_powf", "sonar_fused_adamw_bf16": "sonar_powf",
		"sonar_fused64_adamw_f32": "sonar_pow64", "sonar_fused64_adamw_bf16": "sonar_pow64"} {
		if !strings.Contains(funcs[k], f) {
			t.Errorf("compute_%d: %s does not call %s", arch, k, f)
		}
	}
	if !strings.Contains(funcs["sonar_fused64_adamw_f32"], "fma.rn.f64") {
		t.Errorf("compute_%d: the double fused kernel has no fma.rn.f64", arch)
	}
	if arch >= 80 && !strings.Contains(s, "cvt.rn.bf16.f32") {
		t.Errorf("compute_%d: bfloat16 rounding should be cvt.rn.bf16.f32", arch)
	}
	// No per-thread copy of the batch (a local depot of >= 1 KB).
	for _, m := range regexp.MustCompile(`__local_depot\d*\[(\d+)\]`).FindAllStringSubmatch(s, -1) {
		if len(m[1]) >= 4 {
			t.Errorf("compute_%d: local memory %s bytes: the batch parameter is copied per thread", arch, m[1])
		}
	}
	if !strings.Contains(s, "fma.rn.f32") || !strings.Contains(s, "div.rn.f32") || !strings.Contains(s, "sqrt.rn.f32") {
		t.Errorf("compute_%d: expected fma.rn, div.rn and sqrt.rn in the PTX", arch)
	}
	// --fmad changes nothing in the kernels themselves (every operation is
	// an _rn intrinsic), only inside libdevice's pow functions.
	// 128-bit accesses with vector loads (param, grad, m, v at least;
	// the accumulation: buffer and gradient), none with scalar ones.
	for _, k := range kernelNames {
		lds := strings.Count(funcs[k], "ld.global.v4.")
		sts := strings.Count(funcs[k], "st.global.v4.")
		wantLd, wantSt := 4, 3
		if strings.HasPrefix(k, "sonar_add") {
			wantLd, wantSt = 2, 1
		}
		if loads == VectorLoads && (lds < wantLd || sts < wantSt) {
			t.Errorf("compute_%d %s loads: %s has %d 128-bit loads and %d stores, want >= %d and %d", arch, loads, k, lds, sts, wantLd, wantSt)
		}
		if loads == ScalarLoads && (lds != 0 || sts != 0) {
			t.Errorf("compute_%d %s loads: %s has %d 128-bit loads and %d stores", arch, loads, k, lds, sts)
		}
	}
	opts := CompileOptions(arch, loads)
	for i, o := range opts {
		if o == "--fmad=true" {
			opts[i] = "--fmad=false"
		}
	}
	ptxNoFMA, err := nv.Compile(KernelSource(), "adamw.cu", opts)
	if err != nil {
		t.Fatalf("compute_%d with --fmad=false: %v", arch, err)
	}
	noFMA := ptxFunctions(string(ptxNoFMA))
	for _, k := range kernelNames {
		if funcs[k] != noFMA[k] {
			t.Errorf("compute_%d: %s differs between --fmad=true and --fmad=false: an operation is not pinned", arch, k)
		}
	}
}

// fusedHarness reads records of (bf16 flag, flags, lr, beta1, beta2,
// weight_decay, eps, bc1, bc2, p, g, m, v, vmax) and writes (p, m, v, vmax)
// as the fused kernel computes and stores them.
const fusedHarness = `
int main() {
  unsigned int hdr[2]; float in[12];
  while (fread(hdr, 4, 2, stdin) == 2 && fread(in, 4, 12, stdin) == 12) {
    SonarFusedTensor t; memset(&t, 0, sizeof t);
    t.lr = in[0]; t.beta1 = in[1]; t.beta2 = in[2]; t.weight_decay = in[3]; t.eps = in[4]; t.flags = hdr[1];
    SonarFusedConsts k = sonar_fused_consts(t, in[5], in[6]);
    float p = in[7], g = in[8], m = in[9], v = in[10], vm = in[11];
    sonar_fused_element(p, g, m, v, vm, k, t.flags);
    if (hdr[0]) { p = SonarBF16::get(SonarBF16::put(p)); m = SonarBF16::get(SonarBF16::put(m));
                  v = SonarBF16::get(SonarBF16::put(v)); vm = SonarBF16::get(SonarBF16::put(vm)); }
    float out[4] = {p, m, v, vm};
    fwrite(out, 4, 4, stdout);
  }
  return 0;
}`

type fusedCase struct {
	bf16          bool
	k             optimizer.FusedCUDA
	p, g, m, v, w float32
	label         string
}

func fusedFlags(k optimizer.FusedCUDA) uint32 {
	var f uint32
	if k.WeightDecay != 0 {
		f |= flagDecay
	}
	if k.Amsgrad {
		f |= flagAmsgrad
	}
	if k.Maximize {
		f |= flagMaximize
	}
	return f
}

// fusedOne is optimizer's fused CUDA reference on one element.
func fusedOne(c fusedCase) [4]float32 {
	if c.bf16 {
		b := optimizer.ForeachBF16
		p, g, m, v, vm := []uint16{b(c.p)}, []uint16{b(c.g)}, []uint16{b(c.m)}, []uint16{b(c.v)}, []uint16{b(c.w)}
		optimizer.FusedCUDAStepBF16(p, g, m, v, vm, c.k)
		f := optimizer.BF16ToF32
		return [4]float32{f(p[0]), f(m[0]), f(v[0]), f(vm[0])}
	}
	p, g, m, v, vm := []float32{c.p}, []float32{c.g}, []float32{c.m}, []float32{c.v}, []float32{c.w}
	optimizer.FusedCUDAStepF32(p, g, m, v, vm, c.k)
	return [4]float32{p[0], m[0], v[0], vm[0]}
}

// TestHostFusedMathMatchesRef is TestHostMathMatchesRef for the fused
// kernels: their arithmetic (the MATH section's sonar_fused_consts and
// sonar_fused_element, compiled for the host) against
// optimizer.FusedCUDAStep, bit for bit, on random and edge-case inputs,
// float32 and bfloat16, several hyper-parameter sets and step counts. The
// bias corrections are inputs on both sides (the kernel computes them with
// CUDA's powf on the device; only the GPU check covers that).
func TestHostFusedMathMatchesRef(t *testing.T) {
	bin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), fusedHarness)
	r := rand.New(rand.NewPCG(13, 17))
	mk := func(lr, b1, b2, eps, wd float64, step int64) optimizer.FusedCUDA {
		return optimizer.FusedCUDAOf(optimizer.Scalars{LR: lr, Beta1: b1, Beta2: b2, Eps: eps, WeightDecay: wd}, step)
	}
	variants := []struct {
		label string
		k     optimizer.FusedCUDA
	}{
		{"default step 1", mk(1e-3, 0.9, 0.999, 1e-8, 1e-2, 1)},
		{"default step 3", mk(1e-3, 0.9, 0.999, 1e-8, 1e-2, 3)},
		{"no decay", mk(3e-4, 0.9, 0.95, 1e-6, 0, 7)},
		{"amsgrad", func() optimizer.FusedCUDA { k := mk(1e-3, 0.9, 0.999, 1e-8, 0.1, 2); k.Amsgrad = true; return k }()},
		{"maximize", func() optimizer.FusedCUDA { k := mk(1e-2, 0.8, 0.99, 1e-8, 1e-2, 5); k.Maximize = true; return k }()},
		{"amsgrad+maximize", func() optimizer.FusedCUDA {
			k := mk(3e-2, 0.5, 0.9, 1e-6, 0.1, 4)
			k.Amsgrad, k.Maximize = true, true
			return k
		}()},
		{"beta1 0.3", mk(1e-3, 0.3, 0.999, 1e-8, 1e-2, 2)},
		{"beta1 0, beta2 0", mk(1e-3, 0, 0, 1e-8, 1e-2, 1)},
		{"step 1000", mk(3e-4, 0.9, 0.95, 1e-6, 0.1, 1000)},
		{"lr 0, eps 0", mk(0, 0.9, 0.999, 0, 1e-2, 2)},
		{"weight decay below float", mk(1e-3, 0.9, 0.999, 1e-8, 1e-50, 2)},
	}
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-40, -1e-40, 1, -1, 3e38, float32(math.Inf(1)),
		float32(math.Inf(-1)), float32(math.NaN())}
	var cases []fusedCase
	for _, bf := range []bool{false, true} {
		for _, vr := range variants {
			for i := 0; i < 3000; i++ {
				c := fusedCase{bf16: bf, k: vr.k, label: vr.label,
					p: float32(r.NormFloat64() * 0.05), g: float32(r.NormFloat64() * math.Pow(10, -5+5*r.Float64())),
					m: float32(r.NormFloat64() * 1e-3), v: float32(r.Float64() * 1e-5), w: float32(r.Float64() * 1e-5)}
				if i < 5*len(special) { // edge values in each slot
					s := special[i%len(special)]
					switch i / len(special) {
					case 0:
						c.g = s
					case 1:
						c.v = float32(math.Abs(float64(s)))
					case 2:
						c.p = s
					case 3:
						c.m = s
					case 4:
						c.w = s
					}
				}
				if bf {
					c.p, c.g, c.m, c.v, c.w = roundBF16(c.p), roundBF16(c.g), roundBF16(c.m), roundBF16(c.v), roundBF16(c.w)
				}
				cases = append(cases, c)
			}
		}
	}
	var in bytes.Buffer
	le := binary.LittleEndian
	for _, c := range cases {
		var bf uint32
		if c.bf16 {
			bf = 1
		}
		_ = binary.Write(&in, le, []uint32{bf, fusedFlags(c.k)})
		k := c.k
		for _, f := range []float32{k.LR, k.Beta1, k.Beta2, k.WeightDecay, k.Eps, k.BC1, k.BC2, c.p, c.g, c.m, c.v, c.w} {
			_ = binary.Write(&in, le, math.Float32bits(f))
		}
	}
	cmd := exec.Command(bin)
	cmd.Stdin = &in
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(cases)*16 {
		t.Fatalf("harness wrote %d bytes for %d cases", len(out), len(cases))
	}
	bad, nan := 0, 0
	for i, c := range cases {
		want := fusedOne(c)
		for j, w := range want {
			got := math.Float32frombits(le.Uint32(out[16*i+4*j:]))
			if w != w {
				nan++
			}
			same := math.Float32bits(got) == math.Float32bits(w) || (got != got && w != w) // NaN payloads: host C vs device differ
			if !c.k.Amsgrad && j == 3 {
				same = true
			}
			if !same {
				bad++
				if bad <= 10 {
					t.Errorf("%s bf16=%v case %d output %d: kernel math %v (%#08x), Go reference %v (%#08x); in p=%v g=%v m=%v v=%v vmax=%v",
						c.label, c.bf16, i, j, got, math.Float32bits(got), w, math.Float32bits(w), c.p, c.g, c.m, c.v, c.w)
				}
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d outputs differ", bad, 4*len(cases))
	}
	t.Logf("%d cases (%d NaN outputs), %d variants, float32 and bfloat16: kernel math == Go reference", len(cases), nan, len(variants))
}

// TestFusedRefDiffersFromForeach guards the reference against being the
// foreach arithmetic under another name: on random data the two disagree in
// a visible share of the values.
func TestFusedRefDiffersFromForeach(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	const n = 4096
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}
	p1, g, m1, v1 := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range p1 {
		p1[i], g[i] = float32(r.NormFloat64()*0.05), float32(r.NormFloat64()*1e-3)
	}
	p2, m2, v2 := append([]float32(nil), p1...), make([]float32, n), make([]float32, n)
	diff := 0
	for step := int64(1); step <= 3; step++ {
		sc := optimizer.ScalarsFor(h, step)
		sc.LR, sc.Beta1, sc.WeightDecay = h.LR, h.Beta1, h.WeightDecay
		optimizer.ForeachStepF32(p1, g, m1, v1, nil, sc)
		optimizer.FusedCUDAStepF32(p2, g, m2, v2, nil, optimizer.FusedCUDAOf(sc, step))
	}
	for i := range p1 {
		if p1[i] != p2[i] || m1[i] != m2[i] || v1[i] != v2[i] {
			diff++
		}
	}
	if diff < n/100 {
		t.Errorf("fused and foreach references agree on %d of %d elements: the test data cannot tell them apart", n-diff, n)
	}
	t.Logf("fused vs foreach reference: %d of %d elements differ after 3 steps", diff, n)
}

// ptxFunctions splits PTX into its functions and entries, by name.
func ptxFunctions(ptx string) map[string]string {
	re := regexp.MustCompile(`(?m)^\s*(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)\(`)
	idx := re.FindAllStringSubmatchIndex(ptx, -1)
	out := map[string]string{}
	for i, m := range idx {
		end := len(ptx)
		if i+1 < len(idx) {
			end = idx[i+1][0]
		}
		out[ptx[m[2]:m[3]]] += ptx[m[0]:end]
	}
	return out
}

// fused64Harness reads records of (bf16 flag, flags, lr, beta1, beta2,
// weight_decay, eps, bc1, bc2 as doubles, p, g, m, v, vmax as floats) and
// writes (p, m, v, vmax) as the kernel of torch 2.8-2.10 computes them.
const fused64Harness = `
int main() {
  unsigned int hdr[2]; double d[7]; float in[5];
  while (fread(hdr, 4, 2, stdin) == 2 && fread(d, 8, 7, stdin) == 7 && fread(in, 4, 5, stdin) == 5) {
    SonarFused64Tensor t; memset(&t, 0, sizeof t);
    t.lr = d[0]; t.beta1 = d[1]; t.beta2 = d[2]; t.weight_decay = d[3]; t.eps = d[4]; t.flags = hdr[1];
    SonarFused64Consts k = sonar_fused64_consts(t, d[5], d[6]);
    float p = in[0], g = in[1], m = in[2], v = in[3], vm = in[4];
    sonar_fused64_element(p, g, m, v, vm, k, t.flags);
    if (hdr[0]) { p = SonarBF16::get(SonarBF16::put(p)); m = SonarBF16::get(SonarBF16::put(m));
                  v = SonarBF16::get(SonarBF16::put(v)); vm = SonarBF16::get(SonarBF16::put(vm)); }
    float out[4] = {p, m, v, vm};
    fwrite(out, 4, 4, stdout);
  }
  return 0;
}`

// TestHostFused64MathMatchesRef is TestHostFusedMathMatchesRef for the
// kernels of torch 2.8 to 2.10 (sonar_fused64_*: decay and moving averages
// in double) against optimizer.FusedCUDA64Step.
func TestHostFused64MathMatchesRef(t *testing.T) {
	bin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), fused64Harness)
	r := rand.New(rand.NewPCG(19, 23))
	mk := func(lr, b1, b2, eps, wd float64, step int64, ams, max bool) optimizer.FusedCUDA64 {
		k := optimizer.FusedCUDA64Of(optimizer.Scalars{LR: lr, Beta1: b1, Beta2: b2, Eps: eps, WeightDecay: wd}, step)
		k.Amsgrad, k.Maximize = ams, max
		return k
	}
	variants := []struct {
		label string
		k     optimizer.FusedCUDA64
	}{
		{"default step 1", mk(1e-3, 0.9, 0.999, 1e-8, 1e-2, 1, false, false)},
		{"default step 4", mk(1e-3, 0.9, 0.999, 1e-8, 1e-2, 4, false, false)},
		{"no decay", mk(3e-4, 0.9, 0.95, 1e-6, 0, 7, false, false)},
		{"amsgrad", mk(1e-3, 0.9, 0.999, 1e-8, 0.1, 2, true, false)},
		{"maximize", mk(1e-2, 0.8, 0.99, 1e-8, 1e-2, 5, false, true)},
		{"amsgrad+maximize", mk(3e-2, 0.5, 0.9, 1e-6, 0.1, 4, true, true)},
		{"beta1 0.3", mk(1e-3, 0.3, 0.999, 1e-8, 1e-2, 2, false, false)},
		{"beta1 0, beta2 0", mk(1e-3, 0, 0, 1e-8, 1e-2, 1, false, false)},
		{"step 1000", mk(3e-4, 0.9, 0.95, 1e-6, 0.1, 1000, false, false)},
		{"weight decay 1e-50 (decays in double)", mk(1e-3, 0.9, 0.999, 1e-8, 1e-50, 2, false, false)},
	}
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-40, -1e-40, 1, -1, 3e38, float32(math.Inf(1)),
		float32(math.Inf(-1)), float32(math.NaN())}
	type c64 struct {
		bf16          bool
		k             optimizer.FusedCUDA64
		p, g, m, v, w float32
		label         string
	}
	var cases []c64
	for _, bf := range []bool{false, true} {
		for _, vr := range variants {
			for i := 0; i < 3000; i++ {
				c := c64{bf16: bf, k: vr.k, label: vr.label,
					p: float32(r.NormFloat64() * 0.05), g: float32(r.NormFloat64() * math.Pow(10, -5+5*r.Float64())),
					m: float32(r.NormFloat64() * 1e-3), v: float32(r.Float64() * 1e-5), w: float32(r.Float64() * 1e-5)}
				if i < 5*len(special) {
					s := special[i%len(special)]
					switch i / len(special) {
					case 0:
						c.g = s
					case 1:
						c.v = float32(math.Abs(float64(s)))
					case 2:
						c.p = s
					case 3:
						c.m = s
					case 4:
						c.w = s
					}
				}
				if bf {
					c.p, c.g, c.m, c.v, c.w = roundBF16(c.p), roundBF16(c.g), roundBF16(c.m), roundBF16(c.v), roundBF16(c.w)
				}
				cases = append(cases, c)
			}
		}
	}
	var in bytes.Buffer
	le := binary.LittleEndian
	for _, c := range cases {
		var bf, fl uint32
		if c.bf16 {
			bf = 1
		}
		if c.k.WeightDecay != 0 {
			fl |= flagDecay
		}
		if c.k.Amsgrad {
			fl |= flagAmsgrad
		}
		if c.k.Maximize {
			fl |= flagMaximize
		}
		_ = binary.Write(&in, le, []uint32{bf, fl})
		k := c.k
		_ = binary.Write(&in, le, []float64{k.LR, k.Beta1, k.Beta2, k.WeightDecay, k.Eps, k.BC1, k.BC2})
		_ = binary.Write(&in, le, []float32{c.p, c.g, c.m, c.v, c.w})
	}
	cmd := exec.Command(bin)
	cmd.Stdin = &in
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(cases)*16 {
		t.Fatalf("harness wrote %d bytes for %d cases", len(out), len(cases))
	}
	bad := 0
	for i, c := range cases {
		var p, g, m, v, vm []byte
		dt := optimizer.Float32
		if c.bf16 {
			dt = optimizer.BFloat16
			p, g, m, v, vm = make([]byte, 2), make([]byte, 2), make([]byte, 2), make([]byte, 2), make([]byte, 2)
			for j, x := range []float32{c.p, c.g, c.m, c.v, c.w} {
				le.PutUint16([][]byte{p, g, m, v, vm}[j], optimizer.ForeachBF16(x))
			}
		} else {
			p, g, m, v, vm = make([]byte, 4), make([]byte, 4), make([]byte, 4), make([]byte, 4), make([]byte, 4)
			for j, x := range []float32{c.p, c.g, c.m, c.v, c.w} {
				le.PutUint32([][]byte{p, g, m, v, vm}[j], math.Float32bits(x))
			}
		}
		if err := optimizer.FusedCUDA64Step(dt, p, g, m, v, vm, c.k); err != nil {
			t.Fatal(err)
		}
		for j, b := range [][]byte{p, m, v, vm} {
			var w float32
			if c.bf16 {
				w = optimizer.BF16ToF32(le.Uint16(b))
			} else {
				w = math.Float32frombits(le.Uint32(b))
			}
			got := math.Float32frombits(le.Uint32(out[16*i+4*j:]))
			same := math.Float32bits(got) == math.Float32bits(w) || (got != got && w != w)
			if !c.k.Amsgrad && j == 3 {
				same = true
			}
			if !same {
				bad++
				if bad <= 10 {
					t.Errorf("%s bf16=%v case %d output %d: kernel math %v (%#08x), Go reference %v (%#08x); in p=%v g=%v m=%v v=%v vmax=%v",
						c.label, c.bf16, i, j, got, math.Float32bits(got), w, math.Float32bits(w), c.p, c.g, c.m, c.v, c.w)
				}
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d outputs differ", bad, 4*len(cases))
	}
	t.Logf("%d cases, %d variants, float32 and bfloat16: kernel math == Go reference", len(cases), len(variants))
}
