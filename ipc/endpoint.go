package ipc

import (
	"errors"
	"fmt"
	"strings"
)

// ErrTransport refuses an endpoint whose transport is not on the allow-list.
var ErrTransport = errors.New("transport not allowed")

// CheckEndpoint is the allow-list of the addresses sonard binds and clients
// connect to. Only two transports authenticate their peers:
//
//   - ipc:///path: a Unix socket file; its directory is 0700 and the file
//     0600, so only processes of the server's user reach it. The abstract
//     namespace (ipc://@name) has no permissions and is refused.
//   - tcp://host:port, only with CURVE (curve true): ZeroMQ authenticates
//     every client key and encrypts the connection.
//
// Everything else (ws://, wss://, inproc://, pgm://, epgm://, tipc://,
// vmci://, udp://, a different spelling of a scheme) is refused.
func CheckEndpoint(addr string, curve bool) error {
	scheme, rest, ok := strings.Cut(addr, "://")
	switch {
	case !ok:
		return fmt.Errorf("%w: %q is not a ZeroMQ endpoint (want ipc:///path or tcp://host:port)", ErrTransport, addr)
	case scheme == "ipc":
		if !strings.HasPrefix(rest, "/") {
			return fmt.Errorf("%w: %q: an ipc:// endpoint must be an absolute path (the abstract namespace, ipc://@name, has no permissions)", ErrTransport, addr)
		}
		return nil
	case scheme == "tcp":
		if !curve {
			return fmt.Errorf("%w: %q: tcp:// needs CURVE authentication (a server secret key and allowed client keys)", ErrTransport, addr)
		}
		return nil
	}
	return fmt.Errorf("%w: %q: only ipc:// and tcp:// with CURVE authenticate their peers (the %s:// transport does not)", ErrTransport, addr, scheme)
}
