package clip

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestClip(t *testing.T) {
	big := strings.Repeat("A", 4<<20)
	for _, tc := range []struct {
		name, in   string
		n          int
		want       string // exact result, or "" to check the prefix and note only
		wantPrefix string
		wantNote   string
	}{
		{name: "short", in: "hello", n: Max, want: "hello"},
		{name: "exactly max", in: strings.Repeat("x", Max), n: Max, want: strings.Repeat("x", Max)},
		{name: "one over", in: strings.Repeat("x", Max+1), n: Max, wantPrefix: strings.Repeat("x", Max), wantNote: "... (201 bytes)"},
		{name: "4 MiB", in: big, n: Max, wantPrefix: strings.Repeat("A", Max), wantNote: "... (4194304 bytes)"},
		{name: "utf8 boundary", in: "ab" + strings.Repeat("é", 10), n: 5, want: "abé... (22 bytes)"},
		{name: "empty", in: "", n: Max, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := N(tc.in, tc.n)
			if tc.want != "" || tc.in == "" {
				if got != tc.want {
					t.Fatalf("N = %q, want %q", got, tc.want)
				}
			} else if !strings.HasPrefix(got, tc.wantPrefix) || !strings.HasSuffix(got, tc.wantNote) {
				t.Fatalf("N = %.40q..., want prefix %.20q and note %q", got, tc.wantPrefix, tc.wantNote)
			}
			if len(got) > tc.n+32 {
				t.Fatalf("N kept %d bytes of %d (limit %d)", len(got), len(tc.in), tc.n)
			}
			if utf8.ValidString(tc.in) && !utf8.ValidString(got) {
				t.Fatalf("N split a UTF-8 sequence: %q", got)
			}
		})
	}
}

func TestQuote(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"sonar-x", `"sonar-x"`},
		{strings.Repeat("B", 1000), `"` + strings.Repeat("B", Max) + `"... (1000 bytes)`},
	} {
		if got := Quote(tc.in); got != tc.want {
			t.Errorf("Quote(%d bytes) = %q, want %q", len(tc.in), got, tc.want)
		}
	}
}
