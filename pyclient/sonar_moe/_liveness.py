"""Is the server still there? The state of a DEALER socket's connection, from its ZeroMQ
monitor (connected / disconnected events) and ZeroMQ heartbeats.

A server that exits or is killed closes its end of the socket: the client's monitor reports
the disconnection at once. A server that hangs (stopped, or its host gone) stops answering
the heartbeats the client sends every ``HEARTBEAT_IVL``; ZeroMQ closes the connection after
``HEARTBEAT_TIMEOUT``. Heartbeats are answered by libzmq's I/O thread, so a server busy
with a long request still answers them.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_IVL_MS = 200
HEARTBEAT_TIMEOUT_MS = 1000
# A connection down this long, with requests waiting, is given up (a request sent while it
# was down would only be delivered to a server that came back: never the same session).
LOST_AFTER = 1.0


def configure(sock: zmq.Socket[Any]) -> None:
    """Heartbeats on a client socket (before connect)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class Link:
    """What the monitor of one socket says about its connection to the server."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        # Up once the ZMTP handshake (with CURVE, the authentication) succeeded: a connection a
        # server refuses is never up, and its closing is not a loss.
        self._mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.up = False
        self.down_since: float | None = None  # when the connection last went down (None: up)
        self.lost_in_flight = 0  # requests in flight when it went down

    @property
    def monitor(self) -> zmq.Socket[Any]:
        return self._mon

    def update(self, in_flight: int) -> None:
        """Take the monitor's events that arrived."""
        while self._mon.poll(0):
            ev = recv_monitor_message(self._mon, zmq.NOBLOCK)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up, self.down_since = True, None
            elif ev == zmq.EVENT_DISCONNECTED and self.up:
                self.up, self.down_since = False, time.monotonic()
                self.lost_in_flight = max(self.lost_in_flight, in_flight)

    def lost(self, in_flight: int) -> str | None:
        """Why the server is to be given up now, or None."""
        self.update(in_flight)
        if self.lost_in_flight:
            return (f"the connection to sonard closed with {self.lost_in_flight} requests in flight "
                    "(the server exited, was killed or stopped answering heartbeats)")
        if self.down_since is not None and in_flight and time.monotonic() - self.down_since > LOST_AFTER:
            return (f"the connection to sonard has been down for {time.monotonic() - self.down_since:.1f} s "
                    "(the server exited, was killed or stopped answering heartbeats)")
        return None

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)
