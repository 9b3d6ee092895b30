package optimizer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
)

// VecSqrt computes dst[i] = sqrt(src[i]) for a block of float32 values. See
// package vml for why torch's float32 square root may be another function
// than the IEEE one.
type VecSqrt func(dst, src []float32)

// Sqrt is the float32 square root a single-tensor step must reproduce: the
// torch of the client computes its denominators with it. The zero value is
// the IEEE (correctly rounded) square root, what torch computes without MKL
// and for bfloat16.
type Sqrt struct {
	call VecSqrt
	mkl  mklKernel
}

// mklKernel names a kernel of MKL's vmsSqrt (high-accuracy mode) whose
// arithmetic the engine reproduces: the CPU's approximate reciprocal square
// root refined by one Newton step in single precision, the lanes MKL treats
// apart computed as its scalar code does (correctly rounded; a negative
// number other than -0 gives the NaN 0x7FC00000).
type mklKernel uint8

const (
	mklNone mklKernel = iota
	// mklSSE is mkl_vml_kernel_sSqrt_EXHAynn, MKL's SSE kernel for CPUs
	// outside Intel's own paths (what it runs on AMD EPYC): unfused multiplies
	// and adds; zero, subnormals, the largest 4095 finite values,
	// infinities, NaNs and negative numbers go to the scalar code.
	mklSSE
	// mklFMA is mkl_vml_kernel_sSqrt_L9HAynn, MKL's kernel for Intel CPUs
	// with AVX2: the same step in fused multiply-adds; every positive normal
	// number stays in the vector code.
	mklFMA
	// mklAVX512 is mkl_vml_kernel_sSqrt_Z0HAynn, MKL's kernel for Intel CPUs
	// with AVX-512: rsqrt14 (exact by the architecture's definition) and one
	// fused correction, y = fma(fma(-s, s, x), 0.5*r, s) with s = r*x; inputs
	// below about 2^-78 scaled first (kernel_avx512_amd64.s).
	mklAVX512
)

// CallSqrt is the square root f computes, called on blocks of elements (a
// library's vector routine: MKL's vmsSqrt loaded by package vml).
func CallSqrt(f VecSqrt) Sqrt { return Sqrt{call: f} }

// MKLSqrts returns the engine's emulations of MKL's vmsSqrt kernels that
// this CPU can compute (none without AVX2 and FMA: the arithmetic needs the
// CPU's own reciprocal square root approximation, which Go code cannot
// compute). An emulation equals vmsSqrt only where MKL runs that kernel, so
// it replaces a call only after CheckMKLSqrt (FindMKLSqrt) or VerifyMKLSqrt
// compared the two.
func MKLSqrts() []Sqrt {
	if !hasMKLSqrt() {
		return nil
	}
	qs := []Sqrt{{mkl: mklSSE}, {mkl: mklFMA}}
	if hasMKLSqrtAVX512() {
		qs = append(qs, Sqrt{mkl: mklAVX512})
	}
	return qs
}

// IsIEEE reports whether q is the IEEE square root.
func (q Sqrt) IsIEEE() bool { return q.call == nil && q.mkl == mklNone }

// IsMKLEmulation reports whether q is one of MKLSqrts.
func (q Sqrt) IsMKLEmulation() bool { return q.mkl != mklNone }

// String names q: "ieee", "call", "mkl-sse", "mkl-fma" or "mkl-avx512".
func (q Sqrt) String() string {
	switch {
	case q.mkl == mklSSE:
		return "mkl-sse"
	case q.mkl == mklFMA:
		return "mkl-fma"
	case q.mkl == mklAVX512:
		return "mkl-avx512"
	case q.call != nil:
		return "call"
	}
	return "ieee"
}

// Apply computes dst[i] = sqrt(src[i]) for i < len(src) with q.
func (q Sqrt) Apply(dst, src []float32) {
	switch {
	case q.mkl != mklNone:
		mklSqrt(q.mkl, dst, src)
	case q.call != nil:
		q.call(dst, src)
	default:
		ieeeSqrt(dst, src)
	}
}

func ieeeSqrt(dst, src []float32) {
	for i := sqrtVec(dst, src); i < len(src); i++ {
		dst[i] = Sqrt32(src[i])
	}
}

// mklSqrt is an MKL emulation's Apply: 8 lanes at a time, the last partial
// group through a padded copy.
func mklSqrt(k mklKernel, dst, src []float32) {
	if !hasMKLSqrt() {
		panic("optimizer: an MKL emulation used on a CPU without AVX2 and FMA")
	}
	i := mklSqrtVec(k, dst, src)
	if i == len(src) {
		return
	}
	var in, out [16]float32
	for j := range in {
		in[j] = 1
	}
	copy(in[:], src[i:])
	mklSqrtVec(k, out[:], in[:])
	copy(dst[i:len(src)], out[:])
}

// mklCheckBlock is the number of inputs compared per call of the library.
const mklCheckBlock = 1 << 16

// FindMKLSqrt returns the first of MKLSqrts that CheckMKLSqrt finds equal
// to call, or an error that gives each one's first difference.
func FindMKLSqrt(call VecSqrt, workers int) (Sqrt, error) {
	qs := MKLSqrts()
	if len(qs) == 0 {
		return Sqrt{}, errors.New("optimizer: MKL's square root cannot be computed on this CPU (no AVX2 and FMA)")
	}
	var errs []error
	for _, q := range qs {
		err := CheckMKLSqrt(q, call, workers)
		if err == nil {
			return q, nil
		}
		errs = append(errs, fmt.Errorf("%v: %w", q, err))
	}
	return Sqrt{}, errors.Join(errs...)
}

// CheckMKLSqrt compares the emulation q with call (MKL's vmsSqrt of the
// library a client's torch uses) on about 52 million inputs chosen to tell kernels
// apart: every float32 of the binades [1, 4) (each entry of the reciprocal
// square root approximation, both exponent parities), of the two lowest
// normal binades (where the Newton step's residual is subnormal) and of the
// two highest (where MKL's scalar code takes over); zero, subnormals,
// infinities, NaNs and negative numbers at a stride; and 2^20 random bit
// patterns. It returns nil when every result is bitwise equal. Another
// kernel of MKL (the other emulation's, or its AVX-512 one with a different
// approximation) differs on a large fraction of these; the approximation
// depends on the mantissa and the exponent's parity only, so the binades
// [1, 4) also hold any difference between the CPU's SSE and AVX encodings
// of it. VerifyMKLSqrt compares all 2^32 inputs.
func CheckMKLSqrt(q Sqrt, call VecSqrt, workers int) error {
	ranges := [][2]uint64{
		{0x3f800000, 0x40800000}, // [1, 4)
		{0x00800000, 0x01800000}, // the two lowest normal binades
		{0x7e800000, 0x7f800000}, // the two highest
	}
	type job struct {
		lo, hi, stride uint64
		random         bool
	}
	var jobs []job
	for _, r := range ranges {
		for lo := r[0]; lo < r[1]; lo += mklCheckBlock {
			jobs = append(jobs, job{lo: lo, hi: min(lo+mklCheckBlock, r[1]), stride: 1})
		}
	}
	// Zero and every 64th subnormal (MKL's scalar code, 10 ns each).
	for lo := uint64(0); lo < 0x00800000; lo += mklCheckBlock << 6 {
		jobs = append(jobs, job{lo: lo, hi: lo + mklCheckBlock<<6, stride: 1 << 6})
	}
	// Every 4096th pattern from 0x7F800000 up: infinities, NaNs, -0 and
	// negative numbers, 2^19 of them.
	for lo := uint64(0x7f800000); lo < 1<<32; lo += mklCheckBlock << 12 {
		jobs = append(jobs, job{lo: lo, hi: min(lo+mklCheckBlock<<12, 1<<32), stride: 1 << 12})
	}
	for i := 0; i < 16; i++ {
		jobs = append(jobs, job{lo: uint64(i), random: true})
	}
	return compareSqrt(q, call, workers, len(jobs), func(j int, in []float32) []float32 {
		jb := jobs[j]
		if jb.random {
			r := rand.New(rand.NewPCG(0x5eed, jb.lo))
			in = in[:mklCheckBlock]
			for i := range in {
				in[i] = math.Float32frombits(r.Uint32())
			}
			return in
		}
		in = in[:0]
		for x := jb.lo; x < jb.hi; x += jb.stride {
			in = append(in, math.Float32frombits(uint32(x)))
		}
		return in
	})
}

// VerifyMKLSqrt compares the emulation q with call on all 2^32 float32 bit
// patterns (about 30 s on a 2-core AMD EPYC with MKL's SSE kernel, most of
// it in MKL's scalar code for the negative half) and returns nil when every
// result is bitwise equal.
func VerifyMKLSqrt(q Sqrt, call VecSqrt, workers int) error {
	return VerifyMKLSqrtRange(q, call, workers, 0, 1<<32, 1)
}

// VerifyMKLSqrtRange is VerifyMKLSqrt for the bit patterns lo, lo+stride,
// ... below hi (hi <= 2^32).
func VerifyMKLSqrtRange(q Sqrt, call VecSqrt, workers int, lo, hi, stride uint64) error {
	if hi > 1<<32 || lo >= hi || stride == 0 {
		return fmt.Errorf("optimizer: bad range [%#x, %#x) stride %d", lo, hi, stride)
	}
	count := (hi - lo + stride - 1) / stride
	return compareSqrt(q, call, workers, int((count+mklCheckBlock-1)/mklCheckBlock), func(j int, in []float32) []float32 {
		first := uint64(j) * mklCheckBlock
		in = in[:min(mklCheckBlock, count-first)]
		for i := range in {
			in[i] = math.Float32frombits(uint32(lo + (first+uint64(i))*stride))
		}
		return in
	})
}

// compareSqrt runs jobs 0..n-1 on workers goroutines: fill writes a job's
// inputs into the buffer it is given, and the results of call and q (an MKL
// emulation) must be bitwise equal. It returns the first difference found.
func compareSqrt(q Sqrt, call VecSqrt, workers, n int, fill func(job int, in []float32) []float32) error {
	if !q.IsMKLEmulation() || !hasMKLSqrt() {
		return fmt.Errorf("optimizer: %v is not an MKL emulation this CPU computes", q)
	}
	workers = max(1, workers)
	var (
		mu    sync.Mutex
		first error
		next  int
		wg    sync.WaitGroup
	)
	take := func() (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		if first != nil || next == n {
			return 0, false
		}
		next++
		return next - 1, true
	}
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			in := make([]float32, mklCheckBlock)
			want := make([]float32, mklCheckBlock)
			got := make([]float32, mklCheckBlock)
			for {
				j, ok := take()
				if !ok {
					return
				}
				x := fill(j, in)
				call(want[:len(x)], x)
				q.Apply(got[:len(x)], x)
				for i := range x {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						mu.Lock()
						if first == nil {
							first = fmt.Errorf("the square root of %#08x (%g) is %#08x, the emulation's %#08x",
								math.Float32bits(x[i]), x[i], math.Float32bits(want[i]), math.Float32bits(got[i]))
						}
						mu.Unlock()
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	return first
}
