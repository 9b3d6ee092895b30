"""Is the server still there? The state of a DEALER socket's connection, from its ZeroMQ
monitor (connected / disconnected events) and ZeroMQ heartbeats.

A server that exits or is killed closes its end of the socket: the client's monitor reports
the disconnection at once. A server that hangs (stopped, or its host gone) stops answering
the heartbeats the client sends every ``HEARTBEAT_IVL``; ZeroMQ closes the connection after
``HEARTBEAT_TIMEOUT``. Heartbeats are answered by libzmq's I/O thread, so a server busy
with a long request still answers them; the timeout is generous because a loaded machine can
stall that thread for a second, and a dropped connection is never resumed (below).

A connection that dropped once is given up: requests in flight lost their replies, and the
server keeps a session only ``reconnect_grace_ms`` after its connection closed, which a client
busy computing cannot tell apart from a short blip. The next call raises
:class:`~._connection.SonarServerDied` instead of meeting "unknown tensor" later.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("sonar_moe")

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum flags are slow on the hot path

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
HEARTBEAT_TTL_MS = 10000  # the server closes our connection after this long without traffic


def configure(sock: zmq.Socket[Any]) -> None:
    """Heartbeats on a client socket (before connect)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)


class Link:
    """What the monitor of one socket says about its connection to the server."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        # Up once the ZMTP handshake (with CURVE, the authentication) succeeded: a connection a
        # server refuses is never up, and its closing is not a loss.
        self._mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.up = False
        self.dropped = False  # the connection was up, then closed
        self.lost_in_flight = 0  # requests in flight when it went down

    def update(self, in_flight: int) -> None:
        """Take the monitor's events that arrived."""
        while int(self._mon.getsockopt(_EVENTS)) & _POLLIN:  # EVENTS is an int option
            ev = recv_monitor_message(self._mon, zmq.NOBLOCK)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
            elif ev == zmq.EVENT_DISCONNECTED and self.up:
                self.up, self.dropped = False, True
                self.lost_in_flight = max(self.lost_in_flight, in_flight)
                log.debug("the connection to sonard closed (%d requests in flight)", in_flight)

    def lost(self, in_flight: int) -> str | None:
        """Why the server is to be given up now, or None."""
        self.update(in_flight)
        if self.dropped:
            return (f"the connection to sonard closed with {self.lost_in_flight} requests in flight "
                    "(the server exited, was killed or stopped answering heartbeats; a session is not resumed)")
        return None

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)
