package main

import "testing"

func TestParseBytes(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"4096", 4096, true},
		{"512M", 512 << 20, true},
		{"64GiB", 64 << 30, true},
		{"2 TB", 2 << 40, true},
		{"3k", 3 << 10, true},
		{"100B", 100, true},
		{"", 0, false},
		{"-1", 0, false},
		{"1.5G", 0, false},
		{"lots", 0, false},
		{"9999999999T", 0, false},
	}
	for _, tc := range tests {
		got, err := parseBytes(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("parseBytes(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestDefaultStateBudget(t *testing.T) {
	b := defaultStateBudget()
	if avail := memAvailable(); avail > 0 && (b <= 0 || b > avail) {
		t.Errorf("default budget %d with %d bytes available", b, avail)
	}
}
