//go:build !linux

package optimizer

func currentCPU() int { return -1 }

func awayFrom(int) (restore func()) { return func() {} }
