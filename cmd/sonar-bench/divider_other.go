//go:build !amd64

package main

// Divider: see divider_amd64.go; not measured off amd64.
type Divider struct {
	YMM float64 `json:"ymm_ns_per_element"`
	ZMM float64 `json:"zmm_ns_per_element,omitempty"`
}

func dividerFloor(int) *Divider { return nil }
