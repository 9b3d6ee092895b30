package train

import "math"

// Schedule is a learning-rate schedule: linear warmup to Peak over Warmup
// steps, then cosine decay to MinFrac*Peak at step Total.
type Schedule struct {
	Peak    float64
	Warmup  int
	Total   int
	MinFrac float64
}

// LR is the learning rate of step (1-based).
func (s Schedule) LR(step int) float64 {
	if s.Warmup > 0 && step <= s.Warmup {
		return s.Peak * float64(step) / float64(s.Warmup)
	}
	if s.Total <= s.Warmup {
		return s.Peak
	}
	p := min(1, float64(step-s.Warmup)/float64(s.Total-s.Warmup))
	lo := s.Peak * s.MinFrac
	return lo + (s.Peak-lo)*0.5*(1+math.Cos(math.Pi*p))
}
