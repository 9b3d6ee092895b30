//go:build !amd64

package optimizer

func stepF32Vec(p, g, m, v, out []float32, s Scalars, k f32) int { return 0 }
func pass2Vec(p, m, sq []float32, k f32) int                     { return 0 }
func sqrtVec(dst, src []float32) int                             { return 0 }

func hasMKLSqrtAVX512() bool                                               { return false }
func hasMKLSqrt() bool                                                     { return false }
func mklSqrtVec(k mklKernel, dst, src []float32) int                       { return 0 }
func stepF32OnePass(p, g, m, v []float32, s Scalars, k f32, sqrt Sqrt) int { return 0 }

func stepBF16Vec(p, g, m, v []uint16, s Scalars, k f32, epsBF float32) int { return 0 }

func fusedF32Vec(p, g, m, v []float32, k fusedScalars) int { return 0 }
func fusedBF16Vec(p, g, m, v []uint16, k fusedScalars) int { return 0 }

func detectISA() ISA { return ISAGo }
