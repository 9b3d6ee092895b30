package ipc

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.uber.org/zap"
)

// ErrTransport refuses an endpoint whose transport is not on the allow-list.
var ErrTransport = errors.New("transport not allowed")

// CheckEndpoint is the allow-list of the addresses sonard binds and clients
// connect to. Only these authenticate their peers:
//
//   - ipc:///path: a Unix socket file; its directory is 0700 and the file
//     0600, so only processes of the server's user reach it. The abstract
//     namespace (ipc://@name) has no permissions and is refused.
//   - unix:///path: sonard's own Unix stream socket (UnixTransport), with the
//     same 0700 directory and 0600 file as ipc://.
//   - tcp://host:port, only with CURVE (curve true): ZeroMQ authenticates
//     every client key and encrypts the connection.
//
// Everything else (ws://, wss://, inproc://, pgm://, epgm://, tipc://,
// vmci://, udp://, a different spelling of a scheme) is refused.
func CheckEndpoint(addr string, curve bool) error {
	scheme, rest, ok := strings.Cut(addr, "://")
	switch {
	case !ok:
		return fmt.Errorf("%w: %q is not an endpoint (want ipc:///path, unix:///path or tcp://host:port)", ErrTransport, addr)
	case scheme == "ipc":
		if !strings.HasPrefix(rest, "/") {
			return fmt.Errorf("%w: %q: an ipc:// endpoint must be an absolute path (the abstract namespace, ipc://@name, has no permissions)", ErrTransport, addr)
		}
		return nil
	case scheme == "unix":
		if !strings.HasPrefix(rest, "/") {
			return fmt.Errorf("%w: %q: a unix:// endpoint must be an absolute path (the abstract namespace has no permissions)", ErrTransport, addr)
		}
		return nil
	case scheme == "tcp":
		if !curve {
			return fmt.Errorf("%w: %q: tcp:// needs CURVE authentication (a server secret key and allowed client keys)", ErrTransport, addr)
		}
		return nil
	}
	return fmt.Errorf("%w: %q: only ipc://, unix:// and tcp:// with CURVE authenticate their peers (the %s:// transport does not)", ErrTransport, addr, scheme)
}

// Endpoint is a listening transport serving a Handler. Open chooses it once,
// from the address's scheme; nothing else branches on the transport.
type Endpoint interface {
	// Serve serves requests until ctx is done.
	Serve(ctx context.Context, h Handler) error
	// PeerPID is the process id of a local client (called from the handler).
	PeerPID(client string) (int, error)
	// Close releases the socket (and its file).
	Close() error
}

// Open listens on addr: unix:///path is a UnixTransport, ipc:// and tcp://
// (with curve) a ZeroMQ Transport.
func Open(addr string, log *zap.Logger, curve *Curve, opts Options) (Endpoint, error) {
	if strings.HasPrefix(addr, "unix://") {
		if curve != nil && curve.ServerSecret != "" {
			return nil, fmt.Errorf("listen: %w: %q: CURVE keys are for tcp://", ErrTransport, addr)
		}
		return ListenUnix(addr, log, opts)
	}
	return Listen(addr, log, curve, opts)
}
