package device

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer"
)

//go:embed adamw.cu
var adamwSource string

// KernelSource is the CUDA C source of the AdamW kernels (adamw.cu).
func KernelSource() string { return adamwSource }

// Kernel names in adamw.cu.
var kernelNames = []string{"sonar_adamw_f32", "sonar_adamw_bf16", "sonar_fused_adamw_f32", "sonar_fused_adamw_bf16",
	"sonar_fused64_adamw_f32", "sonar_fused64_adamw_bf16", "sonar_add_f32", "sonar_add_bf16"}

// The batch layout of adamw.cu (SonarTensor, SonarBatch). A test
// compiles the source's layout block with the host C compiler and checks
// these numbers.
const (
	MaxBatchTensors = 44    // SONAR_MAX_TENSORS
	ChunkElems      = 65536 // SONAR_CHUNK
	threadsPerBlock = 256   // SONAR_THREADS

	tensorDescSize = 88 // sizeof(SonarTensor)
	offParam       = 0
	offGrad        = 8
	offExpAvg      = 16
	offExpAvgSq    = 24
	offMaxExpAvgSq = 32
	offNumel       = 40
	offFirstChunk  = 48
	offDecay       = 56
	offBeta1W      = 60
	offBeta2       = 64
	offOneMinusB2  = 68
	offNegStepSize = 72
	offBC2Sqrt     = 76
	offEps         = 80
	offFlags       = 84
	// SonarFusedTensor: the same size, pointers and flags; these floats.
	offFusedLR    = 56
	offFusedBeta1 = 60
	offFusedBeta2 = 64
	offFusedWD    = 68
	offFusedEps   = 72
	offFusedStep  = 76
	// SonarFused64Tensor: the same pointers, then doubles, step and flags.
	MaxFused64Tensors = 39 // SONAR_MAX_FUSED64
	fused64DescSize   = 104
	off64LR           = 56
	off64Beta1        = 64
	off64Beta2        = 72
	off64WD           = 80
	off64Eps          = 88
	off64Step         = 96
	off64Flags        = 100
	batch64OffN       = MaxFused64Tensors * fused64DescSize
	batch64OffTotal   = batch64OffN + 8
	batch64Size       = batch64OffTotal + 8
	batchOffN         = MaxBatchTensors * tensorDescSize // offsetof(SonarBatch, n)
	batchOffTotal     = batchOffN + 8                    // offsetof(SonarBatch, total_chunks)
	batchSize         = batchOffTotal + 8                // sizeof(SonarBatch)
	flagDecay         = 1
	flagAmsgrad       = 2
	flagMaximize      = 4
	maxKernelParams   = 4096 // the kernel parameter limit of every CUDA version
)

// Loads is how the kernels move a tensor's elements (adamw.cu, LOOPS).
type Loads int

const (
	// ScalarLoads: one element per thread and access, the kernels as
	// checked on a GPU (an H200, 2026-12-04). The default until a GPU run
	// has checked VectorLoads bit for bit.
	ScalarLoads Loads = iota
	// VectorLoads: where every array of a tensor starts on a 16-byte
	// boundary, each thread loads and stores 16 bytes of each array at once
	// (4 float32 or 8 bfloat16 values), the chunk's tail one element at a
	// time. Checked on the host (TestHostLaunches) and compiled by NVRTC;
	// not yet run on a GPU.
	VectorLoads
)

// String is the name ParseLoads reads.
func (l Loads) String() string {
	if l == ScalarLoads {
		return "scalar"
	}
	return "vector"
}

// ParseLoads reads "vector" or "scalar".
func ParseLoads(s string) (Loads, error) {
	switch s {
	case "vector":
		return VectorLoads, nil
	case "scalar":
		return ScalarLoads, nil
	}
	return 0, fmt.Errorf("kernel loads %q: want vector or scalar", s)
}

// CompileOptions are the NVRTC options for the kernels: PTX for the virtual
// architecture compute_<arch>, and the arithmetic options torch's kernels
// are built with (nvcc's defaults: no flush of subnormals, correctly rounded
// division and square root, contraction into FMAs allowed). Contraction
// matters only inside CUDA's pow (the fused kernels' bias corrections, which
// must round as torch's do): every operation of adamw.cu itself is an `_rn`
// intrinsic, which is never contracted (a test compiles the kernels with
// --fmad=false too and finds them identical). ScalarLoads defines
// SONAR_VEC=0.
func CompileOptions(arch int, loads Loads) []string {
	o := []string{
		fmt.Sprintf("--gpu-architecture=compute_%d", arch),
		"--fmad=true", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
	}
	if loads == ScalarLoads {
		o = append(o, "-DSONAR_VEC=0")
	}
	return o
}

// CompileKernels compiles the embedded source to PTX for compute_<arch>.
func CompileKernels(nv *cuda.NVRTC, arch int, loads Loads) ([]byte, error) {
	ptx, err := nv.Compile(adamwSource, "adamw.cu", CompileOptions(arch, loads))
	if err != nil {
		return nil, fmt.Errorf("compiling the AdamW kernels (%s loads) for compute_%d: %w", loads, arch, err)
	}
	return ptx, nil
}

// Launch is one tensor of an AdamW batch: device pointers (Param, ExpAvg,
// ExpAvgSq and, with amsgrad, MaxExpAvgSq updated in place; Grad read) and
// the step's scalars, computed by the client as torch does. Scalars.Fused
// selects torch's fused arithmetic (the sonar_fused_adamw kernels), which
// also needs Step, the tensor's step count after this update.
type Launch struct {
	Param, Grad, ExpAvg, ExpAvgSq, MaxExpAvgSq cuda.DevicePtr
	Numel                                      int64
	Scalars                                    optimizer.Scalars
	Step                                       int64
}

// AddItem is one tensor of an accumulation batch: Dst += Src.
type AddItem struct {
	Dst, Src cuda.DevicePtr
	Numel    int64
}

// batchKind is the arithmetic of a batch: 0 foreach, 1 fused, 2 fused of
// torch 2.8 to 2.10 (partly double).
func batchKind(sc optimizer.Scalars) int {
	switch {
	case !sc.Fused:
		return 0
	case sc.FusedDouble:
		return 2
	}
	return 1
}

// maxBatch is the number of tensors one launch of that kind takes.
func maxBatch(kind int) int {
	if kind == 2 {
		return MaxFused64Tensors
	}
	return MaxBatchTensors
}

// PackBatch lays out up to MaxBatchTensors tensors as the kernels' SonarBatch
// parameter (SonarFusedBatch when the items are fused; SonarFused64Batch of
// up to MaxFused64Tensors when they are fused in torch 2.8-2.10's double
// arithmetic: one kind per batch) and returns it with the number of chunks
// it covers.
func PackBatch(items []Launch) ([]byte, uint64, error) {
	if len(items) == 0 {
		return nil, 0, fmt.Errorf("device: batch of 0 tensors (1..%d)", MaxBatchTensors)
	}
	kind := batchKind(items[0].Scalars)
	if len(items) > maxBatch(kind) {
		return nil, 0, fmt.Errorf("device: batch of %d tensors (1..%d)", len(items), maxBatch(kind))
	}
	if kind == 2 {
		return packFused64(items)
	}
	b := make([]byte, batchSize)
	le := binary.LittleEndian
	var chunks uint64
	fused := kind == 1
	for i, it := range items {
		if batchKind(it.Scalars) != kind {
			return nil, 0, fmt.Errorf("device: tensor %d: fused and foreach tensors in one batch", i)
		}
		if err := checkLaunch(i, it); err != nil {
			return nil, 0, err
		}
		d := b[i*tensorDescSize : (i+1)*tensorDescSize]
		sc := it.Scalars
		le.PutUint64(d[offParam:], uint64(it.Param))
		le.PutUint64(d[offGrad:], uint64(it.Grad))
		le.PutUint64(d[offExpAvg:], uint64(it.ExpAvg))
		le.PutUint64(d[offExpAvgSq:], uint64(it.ExpAvgSq))
		if sc.Amsgrad {
			le.PutUint64(d[offMaxExpAvgSq:], uint64(it.MaxExpAvgSq))
		}
		le.PutUint64(d[offNumel:], uint64(it.Numel))
		le.PutUint64(d[offFirstChunk:], chunks)
		type slot struct {
			off int
			v   float64
		}
		slots := []slot{{offDecay, sc.Decay}, {offBeta1W, sc.Beta1W}, {offBeta2, sc.Beta2}, {offOneMinusB2, sc.OneMinusB2},
			{offNegStepSize, sc.NegStepSize}, {offBC2Sqrt, sc.BC2Sqrt}, {offEps, sc.Eps}}
		flags := scalarFlags(sc)
		if fused {
			if it.Step < 1 {
				return nil, 0, fmt.Errorf("device: tensor %d: fused step count %d", i, it.Step)
			}
			// torch's state_step is a float32 tensor; the kernel reads it as float.
			slots = []slot{{offFusedLR, sc.LR}, {offFusedBeta1, sc.Beta1}, {offFusedBeta2, sc.Beta2},
				{offFusedWD, sc.WeightDecay}, {offFusedEps, sc.Eps}, {offFusedStep, float64(float32(it.Step))}}
			// The fused kernel decays when its float weight_decay is not 0.
			flags &^= flagDecay
			if float32(sc.WeightDecay) != 0 {
				flags |= flagDecay
			}
		}
		for _, f := range slots {
			// Python float -> opmath float: round to nearest, as c10::Scalar::to<float>
			// (foreach) and static_cast<float> (fused).
			le.PutUint32(d[f.off:], math.Float32bits(float32(f.v)))
		}
		le.PutUint32(d[offFlags:], flags)
		chunks += uint64((it.Numel + ChunkElems - 1) / ChunkElems)
	}
	le.PutUint32(b[batchOffN:], uint32(len(items)))
	le.PutUint64(b[batchOffTotal:], chunks)
	return b, chunks, nil
}

func scalarFlags(sc optimizer.Scalars) uint32 {
	var f uint32
	if sc.ApplyDecay {
		f |= flagDecay
	}
	if sc.Amsgrad {
		f |= flagAmsgrad
	}
	if sc.Maximize {
		f |= flagMaximize
	}
	return f
}

// checkLaunch validates one tensor's pointers and size.
func checkLaunch(i int, it Launch) error {
	if it.Numel <= 0 {
		return fmt.Errorf("device: tensor %d: numel %d", i, it.Numel)
	}
	if it.Param == 0 || it.Grad == 0 || it.ExpAvg == 0 || it.ExpAvgSq == 0 {
		return fmt.Errorf("device: tensor %d: null device pointer", i)
	}
	if it.Scalars.Amsgrad && it.MaxExpAvgSq == 0 {
		return fmt.Errorf("device: tensor %d: amsgrad without max_exp_avg_sq", i)
	}
	return nil
}

// packFused64 lays out a SonarFused64Batch: the hyper-parameters as the
// doubles torch 2.8 to 2.10's fused kernel takes, the step as float.
func packFused64(items []Launch) ([]byte, uint64, error) {
	b := make([]byte, batch64Size)
	le := binary.LittleEndian
	var chunks uint64
	for i, it := range items {
		if batchKind(it.Scalars) != 2 {
			return nil, 0, fmt.Errorf("device: tensor %d: fused and foreach tensors in one batch", i)
		}
		if err := checkLaunch(i, it); err != nil {
			return nil, 0, err
		}
		if it.Step < 1 {
			return nil, 0, fmt.Errorf("device: tensor %d: fused step count %d", i, it.Step)
		}
		sc := it.Scalars
		d := b[i*fused64DescSize : (i+1)*fused64DescSize]
		le.PutUint64(d[offParam:], uint64(it.Param))
		le.PutUint64(d[offGrad:], uint64(it.Grad))
		le.PutUint64(d[offExpAvg:], uint64(it.ExpAvg))
		le.PutUint64(d[offExpAvgSq:], uint64(it.ExpAvgSq))
		if sc.Amsgrad {
			le.PutUint64(d[offMaxExpAvgSq:], uint64(it.MaxExpAvgSq))
		}
		le.PutUint64(d[offNumel:], uint64(it.Numel))
		le.PutUint64(d[offFirstChunk:], chunks)
		for _, f := range []struct {
			off int
			v   float64
		}{{off64LR, sc.LR}, {off64Beta1, sc.Beta1}, {off64Beta2, sc.Beta2}, {off64WD, sc.WeightDecay}, {off64Eps, sc.Eps}} {
			le.PutUint64(d[f.off:], math.Float64bits(f.v))
		}
		le.PutUint32(d[off64Step:], math.Float32bits(float32(it.Step)))
		flags := scalarFlags(sc) &^ flagDecay
		if sc.WeightDecay != 0 { // that kernel tests the double
			flags |= flagDecay
		}
		le.PutUint32(d[off64Flags:], flags)
		chunks += uint64((it.Numel + ChunkElems - 1) / ChunkElems)
	}
	le.PutUint32(b[batch64OffN:], uint32(len(items)))
	le.PutUint64(b[batch64OffTotal:], chunks)
	return b, chunks, nil
}

// packAdd lays out an accumulation batch (Dst as param, Src as grad).
func packAdd(items []AddItem) ([]byte, uint64, error) {
	ts := make([]Launch, len(items))
	for i, it := range items {
		ts[i] = Launch{Param: it.Dst, Grad: it.Src, ExpAvg: it.Dst, ExpAvgSq: it.Dst, Numel: it.Numel}
	}
	return PackBatch(ts)
}

// gridFor is the number of blocks for a batch of chunks: enough to fill the
// device several times over, never more than there are chunks.
func gridFor(chunks uint64, sms int) uint32 {
	limit := uint64(max(sms, 1)) * 8
	return uint32(min(chunks, limit))
}

// Kernels are the AdamW kernels loaded on one device.
type Kernels struct {
	dv    *cuda.Device
	mod   *cuda.Module
	fn    map[string]*cuda.Function
	Arch  int    // the compute_<Arch> the PTX was built for
	PTX   []byte // as compiled (NUL-terminated)
	Loads Loads  // how the kernels access memory (LoadPTX: ScalarLoads, which it cannot tell)
}

// LoadKernels compiles the kernels with NVRTC for dv's compute capability
// (or the newest architecture below it that NVRTC knows) and loads them.
func LoadKernels(dv *cuda.Device, nv *cuda.NVRTC, loads Loads) (*Kernels, error) {
	arch, err := nv.PickArch(dv.Major, dv.Minor)
	if err != nil {
		return nil, fmt.Errorf("loading kernels on %s: %w", dv.Name, err)
	}
	ptx, err := CompileKernels(nv, arch, loads)
	if err != nil {
		return nil, err
	}
	k, err := LoadPTX(dv, ptx, arch)
	if err != nil {
		return nil, err
	}
	k.Loads = loads
	return k, nil
}

// LoadPTX loads kernels already compiled for compute_<arch> (CompileKernels).
func LoadPTX(dv *cuda.Device, ptx []byte, arch int) (*Kernels, error) {
	mod, err := dv.LoadModule(ptx)
	if err != nil {
		return nil, fmt.Errorf("loading kernels on %s: %w", dv.Name, err)
	}
	k := &Kernels{dv: dv, mod: mod, fn: map[string]*cuda.Function{}, Arch: arch, PTX: ptx}
	for _, n := range kernelNames {
		f, err := mod.Function(n)
		if err != nil {
			_ = mod.Unload()
			return nil, err
		}
		k.fn[n] = f
	}
	return k, nil
}

// Close unloads the kernels.
func (k *Kernels) Close() error { return k.mod.Unload() }

func kernelFor(prefix string, dt optimizer.DType) (string, error) {
	switch dt {
	case optimizer.Float32:
		return prefix + "_f32", nil
	case optimizer.BFloat16:
		return prefix + "_bf16", nil
	}
	return "", fmt.Errorf("device: dtype %v not supported", dt)
}

// AdamW queues one AdamW step of every tensor on s: one launch per
// MaxBatchTensors (fused double: MaxFused64Tensors) tensors, of the kernel
// of the items' arithmetic (foreach, fused or fused double: one kind per
// call). The host does not wait; record an event to know when the update
// is done.
func (k *Kernels) AdamW(s *cuda.Stream, dt optimizer.DType, items []Launch) error {
	if len(items) == 0 {
		return nil
	}
	kind := batchKind(items[0].Scalars)
	prefix := [...]string{"sonar_adamw", "sonar_fused_adamw", "sonar_fused64_adamw"}[kind]
	return launchBatches(k, s, prefix, dt, items, maxBatch(kind), PackBatch)
}

// Accumulate queues Dst += Src (in the dtype, as autograd accumulates .grad)
// for every item on s.
func (k *Kernels) Accumulate(s *cuda.Stream, dt optimizer.DType, items []AddItem) error {
	return launchBatches(k, s, "sonar_add", dt, items, MaxBatchTensors, packAdd)
}

// launchBatches launches kernel prefix (for dtype dt) once per
// MaxBatchTensors items, each batch packed into one kernel parameter.
func launchBatches[T any](k *Kernels, s *cuda.Stream, prefix string, dt optimizer.DType, items []T, per int,
	pack func([]T) ([]byte, uint64, error)) error {
	name, err := kernelFor(prefix, dt)
	if err != nil {
		return err
	}
	for len(items) > 0 {
		n := min(len(items), per)
		batch, chunks, err := pack(items[:n])
		if err != nil {
			return err
		}
		if err := k.fn[name].Launch(s, cuda.Dim3{X: gridFor(chunks, k.dv.SMs)}, cuda.Dim3{X: threadsPerBlock}, 0, cuda.NewArgs().Bytes(batch)); err != nil {
			return err
		}
		items = items[n:]
	}
	return nil
}
