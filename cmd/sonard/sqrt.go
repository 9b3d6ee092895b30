package main

import (
	"sync"
	"time"

	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/optimizer/vml"
	"go.uber.org/zap"
)

// sqrtLoader gives a client's session the float32 square root of its torch:
// MKL's vmsSqrt from the library the client names (package vml), replaced
// by the engine's emulation of the MKL kernel it runs where emulate is set
// and optimizer.FindMKLSqrt finds one bitwise equal. The emulation is
// computed in the step's own pass; a call into the library needs a second
// pass over each block, and MKL's kernel on AMD CPUs costs 0.8 ns an
// element (docs/benchmarks.md). Each library is loaded and checked once.
type sqrtLoader struct {
	log     *zap.Logger
	emulate bool
	workers int

	mu   sync.Mutex
	libs map[string]optimizer.Sqrt
}

func (l *sqrtLoader) load(path string) (optimizer.Sqrt, string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	name := "mkl:" + path
	if q, ok := l.libs[path]; ok {
		return q, name, nil
	}
	lib, err := vml.Load(path)
	if err != nil {
		return optimizer.Sqrt{}, "", err
	}
	q := optimizer.CallSqrt(lib.Apply)
	if l.emulate {
		start := time.Now()
		emu, err := optimizer.FindMKLSqrt(lib.Apply, l.workers)
		if err != nil {
			l.log.Info("float32 sqrt: calling MKL's vmsSqrt (no emulation equals this library's on this CPU)",
				zap.String("lib", path), zap.Error(err), zap.Duration("check", time.Since(start)))
		} else {
			q = emu
			l.log.Info("float32 sqrt: MKL's vmsSqrt emulated in the step's pass (checked bitwise equal)",
				zap.String("lib", path), zap.Stringer("kernel", emu), zap.Duration("check", time.Since(start)))
		}
	}
	if l.libs == nil {
		l.libs = map[string]optimizer.Sqrt{}
	}
	l.libs[path] = q
	return q, name, nil
}
