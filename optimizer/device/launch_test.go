package device

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
)

// launchHarness runs one launch of a kernel on the host: every thread of
// every block in turn, through the LOOPS section of adamw.cu (the code the
// GPU runs, compiled by the host compiler). It reads a header (kind: 0
// foreach, 1 fused, 2 fused of torch 2.8-2.10, 3 accumulation; dtype: 0
// float32, 1 bfloat16; blocks; arena bytes; batch bytes), the batch as
// PackBatch laid it out (pointers are offsets into the arena) and the arena.
// It writes the arena as the launch left it, then as a plain loop over each
// tensor's elements leaves it (the same element functions, no chunks, no
// pieces, no threads): the reference for the walk.
const launchHarness = `
#include <stdlib.h>
template <class B> static void rebase(B* b, unsigned long long base) {
  for (unsigned int i = 0; i < b->n; i++) {
    b->t[i].param += base; b->t[i].grad += base; b->t[i].exp_avg += base; b->t[i].exp_avg_sq += base;
    if (b->t[i].max_exp_avg_sq) b->t[i].max_exp_avg_sq += base;
  }
}
template <class S, class D, class Op> static void plain(const D& t, const Op& op) {
  typedef typename S::T T;
  T* P = (T*)t.param; const T* G = (const T*)t.grad; T* M = (T*)t.exp_avg; T* V = (T*)t.exp_avg_sq;
  T* VM = (T*)sonar_vmax(t);
  for (long long j = 0; j < t.numel; j++) {
    float p = S::get(P[j]), m = S::get(M[j]), v = S::get(V[j]), vm = VM ? S::get(VM[j]) : 0.0f;
    op(p, S::get(G[j]), m, v, vm);
    P[j] = S::put(p); M[j] = S::put(m); V[j] = S::put(v);
    if (VM) VM[j] = S::put(vm);
  }
}
// launch runs kernel(g) as every thread g of every block of a launch, one after another.
template <class K> static void launch(unsigned long long blocks, const K& kernel) {
  for (unsigned long long k = 0; k < blocks; k++)
    for (unsigned int th = 0; th < SONAR_THREADS; th++) { SonarGrid g = {k, blocks, th}; kernel(g); }
}
template <class S> static void run(int kind, void* batch, unsigned long long blocks, bool reference) {
  if (kind == 1) {
    SonarFusedBatch* b = (SonarFusedBatch*)batch;
    if (!reference) {
      launch(blocks, [&](const SonarGrid& g) { sonar_fused_batch<S>(*b, g); });
      return;
    }
    for (unsigned int i = 0; i < b->n; i++) {
      const SonarFusedTensor& t = b->t[i];
      const SonarFusedConsts c = sonar_fused_consts(t, S_SUB(1.0f, sonar_powf(t.beta1, t.step)), S_SUB(1.0f, sonar_powf(t.beta2, t.step)));
      plain<S>(t, [&](float& p, float g, float& m, float& v, float& vm) { sonar_fused_element(p, g, m, v, vm, c, t.flags); });
    }
  } else if (kind == 2) {
    SonarFused64Batch* b = (SonarFused64Batch*)batch;
    if (!reference) {
      launch(blocks, [&](const SonarGrid& g) { sonar_fused64_batch<S>(*b, g); });
      return;
    }
    for (unsigned int i = 0; i < b->n; i++) {
      const SonarFused64Tensor& t = b->t[i];
      const double st = (double)t.step;
      const SonarFused64Consts c = sonar_fused64_consts(t, D_SUB(1.0, sonar_pow64(t.beta1, st)), D_SUB(1.0, sonar_pow64(t.beta2, st)));
      plain<S>(t, [&](float& p, float g, float& m, float& v, float& vm) { sonar_fused64_element(p, g, m, v, vm, c, t.flags); });
    }
  } else {
    SonarBatch* b = (SonarBatch*)batch;
    if (!reference) {
      launch(blocks, [&](const SonarGrid& g) { if (kind == 0) sonar_adamw_batch<S>(*b, g); else sonar_add_batch<S>(*b, g); });
      return;
    }
    for (unsigned int i = 0; i < b->n; i++) {
      const SonarTensor& t = b->t[i];
      if (kind == 0) {
        plain<S>(t, [&](float& p, float g, float& m, float& v, float& vm) { sonar_adamw_element<S>(p, g, m, v, vm, t); });
      } else {
        typedef typename S::T T;
        T* A = (T*)t.param; const T* G = (const T*)t.grad;
        for (long long j = 0; j < t.numel; j++) A[j] = S::put(sonar_add_element<S>(S::get(A[j]), S::get(G[j])));
      }
    }
  }
}
int main() {
  unsigned long long h[5];
  if (fread(h, 8, 5, stdin) != 5) return 2;
  const int kind = (int)h[0], bf16 = (int)h[1];
  const unsigned long long blocks = h[2], an = h[3], bn = h[4];
  unsigned char* arena[2];
  void* batch[2];
  for (int r = 0; r < 2; r++) {
    arena[r] = (unsigned char*)aligned_alloc(256, (an + 255) / 256 * 256);
    batch[r] = aligned_alloc(16, (bn + 15) / 16 * 16);
  }
  if (fread(batch[0], 1, bn, stdin) != bn || fread(arena[0], 1, an, stdin) != an) return 2;
  memcpy(batch[1], batch[0], bn);
  memcpy(arena[1], arena[0], an);
  for (int r = 0; r < 2; r++) {
    const unsigned long long base = (unsigned long long)arena[r];
    if (kind == 1) rebase((SonarFusedBatch*)batch[r], base);
    else if (kind == 2) rebase((SonarFused64Batch*)batch[r], base);
    else rebase((SonarBatch*)batch[r], base);
  }
  for (int r = 0; r < 2; r++) {
    if (bf16) run<SonarBF16>(kind, batch[r], blocks, r == 1); else run<SonarF32>(kind, batch[r], blocks, r == 1);
    fwrite(arena[r], 1, an, stdout);
  }
  return 0;
}`

// launchTensor is one tensor of a host launch: where each of its arrays
// starts in the arena (0: none), its size and scalars.
type launchTensor struct {
	at    [5]int64 // p, g, m, v, vmax
	numel int64
	sc    optimizer.Scalars
}

// Where an array of a test tensor sits against a 16-byte boundary.
const (
	alignAll     = iota // every array on a 16-byte boundary: the pieces path
	alignNotGrad        // the gradient one element past one: one element at a time
	alignNotVmax        // amsgrad's vmax one element past one
	alignNone           // every array one element past one
)

// TestHostLaunches runs every kernel's launch on the host (launchHarness),
// built with vector and with scalar loads, over batches of tensors of sizes
// around the piece and chunk boundaries, with arrays on and off 16-byte
// boundaries, several grid sizes, float32 and bfloat16: the arena the
// launch leaves must be the one a plain loop over each tensor leaves, byte
// for byte (guards around every array included), and for foreach and
// accumulation also what the Go reference computes. It checks the kernels'
// walk (chunks, grid stride, pieces, tails) with the source the GPU runs;
// the element arithmetic has its own tests (TestHostMathMatchesRef and
// the fused ones), and the GPU check runs both on a device.
func TestHostLaunches(t *testing.T) {
	builds := map[string]string{
		"vector": hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), section(t, "LOOPS"), launchHarness),
		"scalar": hostBuild(t, hostPrelude, section(t, "LAYOUT"), section(t, "MATH"), "#define SONAR_VEC 0\n", section(t, "LOOPS"), launchHarness),
	}
	h := optimizer.Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	kinds := []struct {
		name string
		kind int
		sc   func(amsgrad bool) optimizer.Scalars
	}{
		{"foreach", 0, func(a bool) optimizer.Scalars {
			h := h
			h.Amsgrad = a
			return optimizer.ScalarsFor(h, 3)
		}},
		{"fused", 1, func(a bool) optimizer.Scalars {
			h := h
			h.Amsgrad = a
			sc := optimizer.ScalarsFor(h, 3)
			sc.Fused, sc.LR, sc.Beta1, sc.WeightDecay = true, h.LR, h.Beta1, h.WeightDecay
			return sc
		}},
		{"fused-double", 2, func(a bool) optimizer.Scalars {
			h := h
			h.Amsgrad = a
			sc := optimizer.ScalarsFor(h, 3)
			sc.Fused, sc.FusedDouble, sc.LR, sc.Beta1, sc.WeightDecay = true, true, h.LR, h.Beta1, h.WeightDecay
			return sc
		}},
		{"accumulate", 3, func(bool) optimizer.Scalars { return optimizer.Scalars{} }},
	}
	// Sizes around a piece (4 or 8 elements) and a chunk (65536).
	sizes := []int64{1, 3, 4, 7, 8, 9, 17, 255, 1000, 4099, ChunkElems - 1, ChunkElems, ChunkElems + 5, 2*ChunkElems + 13}
	r := rand.New(rand.NewPCG(3, 5))
	for _, dt := range []optimizer.DType{optimizer.Float32, optimizer.BFloat16} {
		for _, k := range kinds {
			for _, layout := range []int{alignAll, alignNotGrad, alignNotVmax, alignNone} {
				for _, sms := range []int{1, 2, 5} {
					name := fmt.Sprintf("%s/%s/layout%d/sms%d", k.name, dt, layout, sms)
					ts := make([]launchTensor, len(sizes))
					for i, n := range sizes {
						ts[i] = launchTensor{numel: n, sc: k.sc(k.kind != 3 && i%2 == 1)}
					}
					arena := fillArena(r, dt, ts, layout)
					for build, bin := range builds {
						runHostLaunch(t, name+"/"+build, bin, k.kind, dt, sms, arena, ts)
					}
				}
			}
		}
	}
}

// guardByte fills the bytes around every array of the arena.
const guardByte = 0xA5

// fillArena places each tensor's arrays in a new arena (64 guard bytes
// around each, on 16-byte boundaries or one element past one as layout
// says), sets their offsets in ts and fills them with random values of the
// dtype.
func fillArena(r *rand.Rand, dt optimizer.DType, ts []launchTensor, layout int) []byte {
	sz := int64(dt.Size())
	var off int64 = 256 // offset 0 means "none"
	for i := range ts {
		for a := 0; a < 5; a++ {
			if a == 4 && !ts[i].sc.Amsgrad {
				continue
			}
			off = (off + 64 + 15) &^ 15
			if layout == alignNone || (layout == alignNotGrad && a == 1) || (layout == alignNotVmax && a == 4) {
				off += sz
			}
			ts[i].at[a] = off
			off += ts[i].numel * sz
		}
	}
	arena := bytes.Repeat([]byte{guardByte}, int(off+64))
	le := binary.LittleEndian
	for _, tn := range ts {
		for a, at := range tn.at {
			if at == 0 {
				continue
			}
			for j := int64(0); j < tn.numel; j++ {
				var x float64
				switch a {
				case 0:
					x = r.NormFloat64() * 0.05
				case 1:
					x = r.NormFloat64() * 1e-3
				case 2:
					x = r.NormFloat64() * 1e-3
				default:
					x = r.Float64() * 1e-5
				}
				if dt == optimizer.BFloat16 {
					le.PutUint16(arena[at+2*j:], optimizer.ForeachBF16(float32(x)))
				} else {
					le.PutUint32(arena[at+4*j:], math.Float32bits(float32(x)))
				}
			}
		}
	}
	return arena
}

// runHostLaunch packs ts as the kernels' batch, runs the host launch and
// compares the arena it leaves with the plain loop's and, for foreach and
// accumulation, with the Go reference's.
func runHostLaunch(t *testing.T, name, bin string, kind int, dt optimizer.DType, sms int, arena []byte, ts []launchTensor) {
	t.Helper()
	var batch []byte
	var chunks uint64
	var err error
	if kind == 3 {
		items := make([]AddItem, len(ts))
		for i, tn := range ts {
			items[i] = AddItem{Dst: cuda.DevicePtr(tn.at[0]), Src: cuda.DevicePtr(tn.at[1]), Numel: tn.numel}
		}
		batch, chunks, err = packAdd(items)
	} else {
		items := make([]Launch, len(ts))
		for i, tn := range ts {
			items[i] = Launch{Param: cuda.DevicePtr(tn.at[0]), Grad: cuda.DevicePtr(tn.at[1]), ExpAvg: cuda.DevicePtr(tn.at[2]),
				ExpAvgSq: cuda.DevicePtr(tn.at[3]), MaxExpAvgSq: cuda.DevicePtr(tn.at[4]), Numel: tn.numel, Scalars: tn.sc, Step: 3}
		}
		batch, chunks, err = PackBatch(items)
	}
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	blocks := gridFor(chunks, sms)
	var in bytes.Buffer
	var bf uint64
	if dt == optimizer.BFloat16 {
		bf = 1
	}
	for _, v := range []uint64{uint64(kind), bf, uint64(blocks), uint64(len(arena)), uint64(len(batch))} {
		_ = binary.Write(&in, binary.LittleEndian, v)
	}
	in.Write(batch)
	in.Write(arena)
	cmd := exec.Command(bin)
	cmd.Stdin = &in
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: harness: %v", name, err)
	}
	if len(out) != 2*len(arena) {
		t.Fatalf("%s: harness wrote %d bytes, want %d", name, len(out), 2*len(arena))
	}
	got, plain := out[:len(arena)], out[len(arena):]
	if bytes.Equal(got, arena) {
		t.Fatalf("%s: the launch changed nothing", name)
	}
	if i := firstDiff(got, plain); i >= 0 {
		t.Errorf("%s (%d blocks): the launch and the plain loop first differ at arena byte %d (%s): %#x vs %#x",
			name, blocks, i, whereIs(ts, int64(i), dt), got[i], plain[i])
		return
	}
	if kind == 1 || kind == 2 {
		return // the fused arithmetic against Go: TestHostFusedMathMatchesRef, TestHostFused64MathMatchesRef
	}
	want := append([]byte(nil), arena...)
	sz := int64(dt.Size())
	for _, tn := range ts {
		arr := func(a int) []byte {
			if tn.at[a] == 0 {
				return nil
			}
			return want[tn.at[a] : tn.at[a]+tn.numel*sz]
		}
		if kind == 3 {
			err = optimizer.ForeachAdd(dt, arr(0), arr(1))
		} else {
			err = optimizer.ForeachStep(dt, arr(0), arr(1), arr(2), arr(3), arr(4), tn.sc)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if i := firstDiff(got, want); i >= 0 {
		t.Errorf("%s: the launch and the Go reference first differ at arena byte %d (%s)", name, i, whereIs(ts, int64(i), dt))
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// whereIs names the tensor array (or guard) that arena byte i belongs to.
func whereIs(ts []launchTensor, i int64, dt optimizer.DType) string {
	names := [5]string{"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
	for k, tn := range ts {
		for a, at := range tn.at {
			if at != 0 && i >= at && i < at+tn.numel*int64(dt.Size()) {
				return fmt.Sprintf("tensor %d (%d elements) %s element %d", k, tn.numel, names[a], (i-at)/int64(dt.Size()))
			}
		}
	}
	return "a guard byte"
}
