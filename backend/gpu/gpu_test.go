package gpu

import (
	"errors"
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/optimizer/device"
)

// On a machine without CUDA, Open says so in words that match ErrNoCUDA
// (sonard then logs "CUDA off" and serves CPU tensors).
func TestOpenWithoutDriver(t *testing.T) {
	tests := []struct {
		name    string
		ordinal int
		maxIdle int
		want    string
	}{
		{"device 0", 0, 4, "no CUDA driver (libcuda.so.1 not found)"},
		{"negative max idle", 0, -1, "want >= 0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Open(tc.ordinal, tc.maxIdle, device.ScalarLoads)
			if err == nil {
				_ = b.Close()
				t.Skip("this machine has a CUDA device")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
			if tc.maxIdle >= 0 && (!errors.Is(err, ErrNoCUDA) || !errors.Is(err, cuda.ErrNoDriver)) {
				t.Errorf("err = %v: want ErrNoCUDA and cuda.ErrNoDriver", err)
			}
		})
	}
}
