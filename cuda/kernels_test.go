package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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
	k     refScalars
	p, g  float32
	m, v  float32
	vmax  float32
	label string
}

// TestHostMathMatchesRef runs the kernel's element arithmetic (compiled for
// the host, with C's correctly rounded fmaf, sqrtf and division standing in
// for __fmaf_rn, __fsqrt_rn and __fdiv_rn) against RefStep's, bit for bit,
// on random and edge-case inputs. It proves the CUDA C and the Go reference
// say the same thing; the GPU check then compares both with torch.
func TestHostMathMatchesRef(t *testing.T) {
	bin := hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), mathHarness)
	r := rand.New(rand.NewPCG(7, 11))
	var cases []mathCase
	base := refScalarsOf(optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}, 3))
	base.flags = flagDecay
	variants := []struct {
		label string
		mod   func(k *refScalars)
	}{
		{"default", func(k *refScalars) {}},
		{"amsgrad", func(k *refScalars) { k.flags |= flagAmsgrad }},
		{"maximize", func(k *refScalars) { k.flags |= flagMaximize }},
		{"no-decay", func(k *refScalars) { k.flags &^= flagDecay }},
		{"big-lerp-weight", func(k *refScalars) { k.w = 0.75 }},
		{"beta2=0 (addcmul value 1)", func(k *refScalars) { k.b2, k.omb2 = 0, 1 }},
		{"addcdiv value 1", func(k *refScalars) { k.negStep = 1 }},
		{"step 1000", func(k *refScalars) {
			s := optimizer.ScalarsFor(optimizer.Hyper{LR: 3e-4, Beta1: 0.9, Beta2: 0.95, Eps: 1e-6, WeightDecay: 0.1}, 1000)
			n := refScalarsOf(s)
			n.flags = k.flags
			*k = n
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
		for _, u := range []uint32{bf, c.k.flags} {
			_ = binary.Write(&in, le, u)
		}
		for _, f := range []float32{c.k.decay, c.k.w, c.k.b2, c.k.omb2, c.k.negStep, c.k.bc2s, c.k.eps, c.p, c.g, c.m, c.v, c.vmax} {
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
		round := identity
		if c.bf16 {
			round = roundBF16
		}
		p, m, v, vm := refElement(c.p, c.g, c.m, c.v, c.vmax, c.k, round)
		acc := round(c.p + c.g)
		want := []float32{p, m, v, vm, acc}
		for j, w := range want {
			got := math.Float32frombits(le.Uint32(out[20*i+4*j:]))
			same := math.Float32bits(got) == math.Float32bits(w) || (got != got && w != w) // NaN payloads: host C vs device differ
			if c.k.flags&flagAmsgrad == 0 && j == 3 {
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
	item := func(numel int64, s optimizer.Scalars) Tensor {
		return Tensor{Param: 0x1000, Grad: 0x2000, ExpAvg: 0x3000, ExpAvgSq: 0x4000, MaxExpAvgSq: 0x5000, Numel: numel, Scalars: s}
	}
	tests := []struct {
		name   string
		items  []Tensor
		chunks uint64
		err    string
	}{
		{"one small", []Tensor{item(10, sc)}, 1, ""},
		{"exact chunk", []Tensor{item(ChunkElems, sc)}, 1, ""},
		{"chunk plus one", []Tensor{item(ChunkElems+1, sc)}, 2, ""},
		{"several", []Tensor{item(3*ChunkElems, sc), item(1, ams), item(2*ChunkElems-1, sc)}, 6, ""},
		{"empty", nil, 0, "batch of 0"},
		{"too many", make([]Tensor, MaxBatchTensors+1), 0, "batch of 45"},
		{"zero numel", []Tensor{item(0, sc)}, 0, "numel 0"},
		{"null pointer", []Tensor{{Grad: 1, ExpAvg: 1, ExpAvgSq: 1, Numel: 1}}, 0, "null device pointer"},
		{"amsgrad without vmax", []Tensor{{Param: 1, Grad: 1, ExpAvg: 1, ExpAvgSq: 1, Numel: 1, Scalars: ams}}, 0, "amsgrad"},
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
				if DevicePtr(le.Uint64(d[offParam:])) != it.Param || DevicePtr(le.Uint64(d[offGrad:])) != it.Grad ||
					DevicePtr(le.Uint64(d[offExpAvg:])) != it.ExpAvg || DevicePtr(le.Uint64(d[offExpAvgSq:])) != it.ExpAvgSq {
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

// TestRefCloseToCPU keeps the reference honest in a coarser way: over many
// steps it must stay within a few ulp of the CPU engine (which rounds a few
// operations differently: addcmul's product and bfloat16 eps).
func TestRefCloseToCPU(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const n = 4096
	h := optimizer.Hyper{LR: 1e-2, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.1}
	p0, m0, v0 := make([]float32, n), make([]float32, n), make([]float32, n)
	p1, m1, v1 := make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range p0 {
		p0[i] = float32(r.NormFloat64())
		p1[i] = p0[i]
	}
	g := make([]float32, n)
	same := 0
	for step := int64(1); step <= 20; step++ {
		for i := range g {
			g[i] = float32(r.NormFloat64() * 0.1)
		}
		sc := optimizer.ScalarsFor(h, step)
		RefStepF32(p0, g, m0, v0, nil, sc)
		optimizer.StepF32(p1, g, m1, v1, nil, sc, nil)
	}
	for i := range p0 {
		if p0[i] == p1[i] {
			same++
		}
		if d := math.Abs(float64(p0[i] - p1[i])); d > 1e-5*math.Abs(float64(p1[i]))+1e-7 {
			t.Fatalf("element %d: reference %v, CPU engine %v", i, p0[i], p1[i])
		}
	}
	t.Logf("%d of %d parameters bitwise equal to the CPU path after 20 steps", same, n)
}

func TestRefStepBytes(t *testing.T) {
	sc := optimizer.ScalarsFor(optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 1e-2}, 1)
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		n := 64
		sz := dt.Size()
		p, g, m, v := make([]byte, n*sz), make([]byte, n*sz), make([]byte, n*sz), make([]byte, n*sz)
		for i := 0; i < n; i++ {
			switch dt {
			case optimizer.Float32:
				binary.LittleEndian.PutUint32(p[4*i:], math.Float32bits(1))
				binary.LittleEndian.PutUint32(g[4*i:], math.Float32bits(0.5))
			default:
				binary.LittleEndian.PutUint16(p[2*i:], RefBF16(1))
				binary.LittleEndian.PutUint16(g[2*i:], RefBF16(0.5))
			}
		}
		if err := RefStep(dt, p, g, m, v, nil, sc); err != nil {
			t.Fatal(err)
		}
		// Step 1 of AdamW moves every parameter by about -lr (sign of g) after decay.
		var got float32
		if dt == optimizer.Float32 {
			got = math.Float32frombits(binary.LittleEndian.Uint32(p))
		} else {
			got = optimizer.BF16ToF32(binary.LittleEndian.Uint16(p))
		}
		if math.Abs(float64(got)-(1*(1-1e-5)-1e-3)) > 1e-2 {
			t.Errorf("%v: p after one step = %v", dt, got)
		}
		if err := RefAdd(dt, g, g); err != nil {
			t.Fatal(err)
		}
	}
	if err := RefStep(optimizer.DType(9), nil, nil, nil, nil, nil, sc); err == nil {
		t.Error("unknown dtype accepted")
	}
}
