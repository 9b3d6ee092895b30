package optimizer

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"
	"unsafe"
)

func benchBufs(n int) (p, g, m, v []float32) {
	r := rand.New(rand.NewPCG(1, 2))
	mk := func(off int) []float32 {
		b := f32s(staggered(4*n, off))
		for i := range b {
			b[i] = float32(r.NormFloat64()) * 0.01
		}
		return b
	}
	p, g, m, v = mk(0), mk(512), mk(0), mk(0) // as the engine and sonar_moe place them
	for i := range v {
		v[i] *= v[i]
	}
	return
}

func BenchmarkStepF32(b *testing.B) {
	const n = 1 << 22
	p, g, m, v := benchBufs(n)
	s := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 3)
	b.SetBytes(28 * n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		StepF32(p, g, m, v, nil, s, Sqrt{})
	}
}

func BenchmarkFMA32(b *testing.B) {
	x := float32(0.1)
	for i := 0; i < b.N; i++ {
		x = FMA32(x, 1.0000001, 1e-9)
	}
	_ = x
}

func BenchmarkStepBF16(b *testing.B) {
	const n = 1 << 22
	p32, g32, m32, v32 := benchBufs(n)
	conv := func(x []float32, off int) []uint16 {
		o := u16s(staggered(2*n, off))
		for i := range o {
			o[i] = F32ToBF16(x[i])
		}
		return o
	}
	p, g, m, v := conv(p32, 0), conv(g32, 512), conv(m32, 0), conv(v32, 0)
	s := ScalarsFor(Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, 3)
	b.SetBytes(14 * n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		StepBF16(p, g, m, v, nil, s)
	}
}

// BenchmarkParallelCaller times one float32 step of a mid-sized tensor on
// two workers, called from a goroutine locked to its thread as sonard's is,
// with the caller taking chunks itself (the default) or only waiting
// (CallerWaits, the engine before 2026-12-02); one worker beside them.
// Compare the modes within one run: go test -bench ParallelCaller ./optimizer
func BenchmarkParallelCaller(b *testing.B) {
	for _, n := range []int{1 << 17, 614400, 1 << 21} {
		p, g, _, _ := benchBufs(n)
		for _, c := range []struct {
			name    string
			workers int
			waits   bool
		}{{"works", 2, false}, {"waits", 2, true}, {"one-worker", 1, false}} {
			b.Run(fmt.Sprintf("n=%d/%s", n, c.name), func(b *testing.B) {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				e := NewEngine()
				e.Workers, e.CallerWaits = c.workers, c.waits
				param := unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*n)
				grad := unsafe.Slice((*byte)(unsafe.Pointer(&g[0])), 4*n)
				t, err := NewTensor("w", Float32, n, Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, param)
				if err != nil {
					b.Fatal(err)
				}
				defer t.Free()
				b.SetBytes(28 * int64(n))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := e.Apply(t, grad, ScalarsFor(t.Hyper, int64(i+1))); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkApplyAfterIdle times the float32 step of one GraniteMoe layer's
// experts (614,400 elements) after the process has slept for a gap, as
// sonard's are between a trainer's requests: its data was in cache when it
// went to sleep and nothing of this process ran since. On a virtual machine
// whose idle CPUs halt, other guests run on the cores meanwhile, and the
// step after a gap of milliseconds is far slower than back to back. Compare
// the gaps within one run: go test -bench ApplyAfterIdle ./optimizer. With
// two workers, steer=true is sonard's default (helpers.go: the helper keeps
// off the caller's CPU), steer=false the engine before 2026-12-05.
func BenchmarkApplyAfterIdle(b *testing.B) {
	const n = 614400
	p, g, _, _ := benchBufs(n)
	param := unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*n)
	grad := unsafe.Slice((*byte)(unsafe.Pointer(&g[0])), 4*n)
	for _, c := range []struct {
		workers int
		steer   bool
	}{{1, false}, {2, false}, {2, true}} {
		for _, gap := range []time.Duration{0, 5 * time.Millisecond, 40 * time.Millisecond} {
			b.Run(fmt.Sprintf("workers=%d/steer=%v/gap=%v", c.workers, c.steer, gap), func(b *testing.B) {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				e := NewEngine()
				e.Workers = c.workers
				e.Steer = c.steer
				t, err := NewTensor("w", Float32, n, Hyper{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}, param)
				if err != nil {
					b.Fatal(err)
				}
				defer t.Free()
				b.SetBytes(28 * n)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if gap > 0 {
						b.StopTimer()
						time.Sleep(gap)
						b.StartTimer()
					}
					if err := e.Apply(t, grad, ScalarsFor(t.Hyper, int64(i+1))); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
