package server

import (
	"os"
	"strings"
	"testing"
)

// The repository's VERSION file is the one version of sonard and the Python package.
func TestVersionMatchesVersionFile(t *testing.T) {
	b, err := os.ReadFile("../VERSION")
	if err != nil {
		t.Fatal(err)
	}
	if v := strings.TrimSpace(string(b)); v != Version {
		t.Fatalf("server.Version is %q but VERSION says %q", Version, v)
	}
}
