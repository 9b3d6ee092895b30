package server

import (
	"crypto/subtle"
	"errors"
	"time"

	"github.com/sonar-moe/sonar/ipc"
	"go.uber.org/zap"
)

// DefaultReconnectGrace is how long a session outlives its connection by
// default: a client whose connection broke (a network blip, or the
// heartbeat timeout) and that reconnects with the same routing id within it
// finds its state again; after it, the state is released.
const DefaultReconnectGrace = 5 * time.Second

// A session's lifetime is its client's connection, as the transport sees it
// (ipc.Watcher): the pid a client reports in hello is only a label for logs
// and metrics, never trusted. A session is released
//
//   - when the client says bye (or, the owner, shutdown);
//   - ReconnectGrace after its connection closed: the process exited or was
//     killed, closed its socket, or stopped answering heartbeats (the
//     transport's heartbeat timeout);
//   - after IdleTimeout without requests, for a client whose connection the
//     transport could not watch (none today: a fallback);
//   - when the server stops.

// Connected is called by the transport when a client's first message
// arrives on a connection it watches.
func (s *Server) Connected(client string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.watched[client] = true
}

// Disconnected is called by the transport when a client's connection
// closed: its session is released after the grace period (Tick).
func (s *Server) Disconnected(client string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.watched, client)
	if ss := s.sessions[client]; ss != nil {
		ss.goneAt = time.Now()
		s.log.Info("client connection closed", zap.String("client", client), zap.Int("pid", ss.hello.PID),
			zap.Duration("grace", s.ReconnectGrace))
	}
}

// Tick releases the sessions whose connection has been closed for longer
// than ReconnectGrace, and unwatched sessions silent for longer than
// IdleTimeout. The transport calls it about once a second.
func (s *Server) Tick(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c, ss := range s.sessions {
		switch {
		case !ss.goneAt.IsZero() && now.Sub(ss.goneAt) >= s.ReconnectGrace:
			s.log.Warn("client gone without saying goodbye: releasing its session", zap.String("client", c),
				zap.Int("pid", ss.hello.PID), zap.Duration("gone", now.Sub(ss.goneAt)))
			s.release(c)
		case ss.goneAt.IsZero() && !s.watched[c] && s.IdleTimeout > 0 && now.Sub(ss.lastSeen) > s.IdleTimeout:
			s.log.Warn("client silent for too long: releasing its session", zap.String("client", c),
				zap.Duration("idle", now.Sub(ss.lastSeen)))
			s.release(c)
		}
	}
}

// mayShutdown checks that a shutdown request carries the admin token.
func (s *Server) mayShutdown(req ipc.Request) error {
	var body ipc.Shutdown
	if len(req.Body) > 0 {
		if err := ipc.DecodeBody(req, &body); err != nil {
			return err
		}
	}
	if s.AdminToken == "" {
		return errors.New("not allowed: this sonard has no owner or admin token (--admin-token-file); stop it with SIGTERM")
	}
	if subtle.ConstantTimeCompare([]byte(body.Token), []byte(s.AdminToken)) != 1 {
		return errors.New("not allowed: only the owner of a private sonard or an admin (the token of --admin-token-file) may stop it")
	}
	return nil
}
