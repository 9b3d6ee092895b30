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
	mkl  bool
}

// CallSqrt is the square root f computes, called on blocks of elements (a
// library's vector routine: MKL's vmsSqrt loaded by package vml).
func CallSqrt(f VecSqrt) Sqrt { return Sqrt{call: f} }

// MKLSqrt is the engine's own computation of MKL's vmsSqrt in high-accuracy
// mode as MKL's SSE kernel for CPUs outside Intel's AVX2 and AVX-512 paths
// does it (mkl_vml_kernel_sSqrt_EXHAynn, what MKL runs on AMD EPYC): the
// approximate reciprocal square root of the CPU refined by one Newton step,
// in single-precision multiplies and adds that are not fused, the lanes MKL
// treats apart (zero, subnormal, the largest 4095 finite values, infinities,
// NaNs, negative numbers) as its scalar code does. It is equal to vmsSqrt
// only where MKL runs that kernel, so it replaces a call only after
// CheckMKLSqrt (or VerifyMKLSqrt) compared the two. ok is false where the CPU
// lacks AVX2 (the arithmetic needs the CPU's own approximation, which Go
// code cannot compute).
func MKLSqrt() (q Sqrt, ok bool) { return Sqrt{mkl: true}, hasMKLSqrt() }

// IsIEEE reports whether q is the IEEE square root.
func (q Sqrt) IsIEEE() bool { return q.call == nil && !q.mkl }

// IsMKLEmulation reports whether q is MKLSqrt.
func (q Sqrt) IsMKLEmulation() bool { return q.mkl }

// Apply computes dst[i] = sqrt(src[i]) for i < len(src) with q.
func (q Sqrt) Apply(dst, src []float32) {
	switch {
	case q.mkl:
		mklSqrt(dst, src)
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

// mklSqrt is MKLSqrt's Apply: 8 lanes at a time, the last partial group
// through a padded copy.
func mklSqrt(dst, src []float32) {
	if !hasMKLSqrt() {
		panic("optimizer: MKLSqrt used on a CPU without AVX2 (MKLSqrt's ok was false)")
	}
	i := mklSqrtVec(dst, src)
	if i == len(src) {
		return
	}
	var in, out [8]float32
	for j := range in {
		in[j] = 1
	}
	copy(in[:], src[i:])
	mklSqrtVec(out[:], in[:])
	copy(dst[i:len(src)], out[:])
}

// mklCheckBlock is the number of inputs compared per call of the library.
const mklCheckBlock = 1 << 16

// CheckMKLSqrt compares MKLSqrt with call (MKL's vmsSqrt of the library a
// client's torch uses) on about 52 million inputs chosen to tell kernels
// apart: every float32 of the binades [1, 4) (each entry of the reciprocal
// square root approximation, both exponent parities), of the two lowest
// normal binades (where the Newton step's residual is subnormal) and of the
// two highest (where MKL's scalar code takes over); zero, subnormals,
// infinities, NaNs and negative numbers at a stride; and 2^20 random bit
// patterns. It returns nil when every result is bitwise equal. Any other
// kernel of MKL (its AVX2 path with FMA, its AVX-512 path with a different
// approximation) differs on a large fraction of these. VerifyMKLSqrt compares
// all 2^32 inputs.
func CheckMKLSqrt(call VecSqrt, workers int) error {
	if !hasMKLSqrt() {
		return errors.New("optimizer: MKL's square root cannot be computed on this CPU (no AVX2)")
	}
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
	return compareSqrt(call, workers, len(jobs), func(j int, in []float32) []float32 {
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

// VerifyMKLSqrt compares MKLSqrt with call on all 2^32 float32 bit patterns
// (about 4.5 s of CPU time on a 2-core AMD EPYC, most of it in the
// library) and returns nil when every result is bitwise equal.
func VerifyMKLSqrt(call VecSqrt, workers int) error {
	if !hasMKLSqrt() {
		return errors.New("optimizer: MKL's square root cannot be computed on this CPU (no AVX2)")
	}
	return compareSqrt(call, workers, (1<<32)/mklCheckBlock, func(j int, in []float32) []float32 {
		in = in[:mklCheckBlock]
		base := uint32(j) * mklCheckBlock
		for i := range in {
			in[i] = math.Float32frombits(base + uint32(i))
		}
		return in
	})
}

// compareSqrt runs jobs 0..n-1 on workers goroutines: fill writes a job's
// inputs into the buffer it is given, and the results of call and MKLSqrt
// must be bitwise equal. It returns the first difference found.
func compareSqrt(call VecSqrt, workers, n int, fill func(job int, in []float32) []float32) error {
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
				mklSqrt(got[:len(x)], x)
				for i := range x {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						mu.Lock()
						if first == nil {
							first = fmt.Errorf("optimizer: MKL's square root of %#08x (%g) is %#08x, the emulation's %#08x",
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
