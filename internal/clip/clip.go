// Package clip shortens text a client supplied (an op, a segment name, a
// library path, a tensor name, a client's name) before sonard quotes it in an
// error reply or a log line. Requests may be 4 MiB; quoting one in full made
// every refusal as large as the request (twice, for an unknown op) and let one
// client write megabytes to the log per request. Every such quote goes
// through this package, so a reply or a log line grows by at most about Max
// bytes per quoted value, whatever the client sent.
package clip

import (
	"strconv"
	"unicode/utf8"

	"go.uber.org/zap"
)

// Max is how many bytes of a client's value are quoted.
const Max = 200

// N returns s when it is at most n bytes, else its first n bytes (cut back to
// a UTF-8 boundary) followed by a note of its full length.
func N(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return cut(s, n) + "... (" + strconv.Itoa(len(s)) + " bytes)"
}

// String is N(s, Max).
func String(s string) string { return N(s, Max) }

// Quote is s quoted as %q does, clipped to Max bytes: the note of the full
// length follows the closing quote.
func Quote(s string) string {
	if len(s) <= Max {
		return strconv.Quote(s)
	}
	return strconv.Quote(cut(s, Max)) + "... (" + strconv.Itoa(len(s)) + " bytes)"
}

// Field is a log field of a client's value, clipped.
func Field(key, s string) zap.Field { return zap.String(key, String(s)) }

// cut is the longest prefix of s of at most n bytes that does not split a
// UTF-8 sequence (a valid string stays valid; invalid bytes are kept as is).
func cut(s string, n int) string {
	i := n
	for i > 0 && i > n-utf8.UTFMax && !utf8.RuneStart(s[i]) {
		i--
	}
	if i > 0 && !utf8.RuneStart(s[i]) { // not UTF-8 there anyway
		i = n
	}
	return s[:i]
}
