// Package gradcheck checks hand-written backward passes of the Go models
// (train/hfmoe, train/moe) against central finite differences, in float64.
// A layer whose output is a tensor is reduced to a scalar with a fixed
// random projection, L = sum(R * out).
package gradcheck

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// Var is one input of the checked function and its analytic gradient.
type Var struct {
	Name string
	X    []float64
	Grad []float64
}

// Case is one check: Loss evaluates the scalar at the current inputs,
// Backward fills every Var's Grad.
type Case struct {
	Vars     []Var
	Loss     func() float64
	Backward func()
	// Branch names piecewise-constant choices (top-k); coordinates whose
	// perturbation changes it are skipped.
	Branch func() string
	// Skip names coordinates whose gradient is not the derivative by design
	// (the padding row of the embedding).
	Skip func(name string, i int) bool
}

// Randn returns n draws of N(0, std^2).
func Randn(rng *rand.Rand, n int, std float64) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = rng.NormFloat64() * std
	}
	return x
}

// Dot is sum(a * b).
func Dot(a, b []float64) float64 {
	var s float64
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// Check compares, on coords random coordinates of every Var, the analytic
// gradient with (L(x+eps) - L(x-eps)) / 2eps, eps 1e-6, within 1e-6
// relative (absolute below 1). A Var with no coordinate checked is an error.
func Check(t *testing.T, c Case, rng *rand.Rand, coords int) {
	t.Helper()
	c.Backward()
	const eps = 1e-6
	branch := func() string {
		if c.Branch == nil {
			return ""
		}
		return c.Branch()
	}
	for _, v := range c.Vars {
		grad := slices.Clone(v.Grad)
		checked := 0
		for range coords {
			i := rng.IntN(len(v.X))
			if c.Skip != nil && c.Skip(v.Name, i) {
				continue
			}
			old := v.X[i]
			before := branch()
			v.X[i] = old + eps
			lp := c.Loss()
			bp := branch()
			v.X[i] = old - eps
			lm := c.Loss()
			bm := branch()
			v.X[i] = old
			if bp != before || bm != before {
				continue
			}
			num := (lp - lm) / (2 * eps)
			if d := math.Abs(num - grad[i]); d > 1e-6*max(1, math.Abs(num)) {
				t.Errorf("%s[%d]: analytic %.10g, numeric %.10g", v.Name, i, grad[i], num)
			}
			checked++
		}
		if checked == 0 {
			t.Errorf("%s: no coordinate checked", v.Name)
		}
	}
	c.Loss() // leave the forward state at the unperturbed values
}

// V is the Var of input x named name with gradient grad.
func V(name string, x, grad []float64) Var { return Var{Name: name, X: x, Grad: grad} }
