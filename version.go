// Package sonar holds what the whole module shares: its version, read from
// the repository's VERSION file (the one place it is written; the Python
// package reads the same file).
package sonar

import (
	_ "embed"
	"strings"
)

//go:embed VERSION
var version string

// Version is the release version of sonard and of the Python package.
var Version = strings.TrimSpace(version)
