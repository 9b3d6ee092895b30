"""How the bytes of requests and replies travel between a client and sonard.

Two channels, one interface (:class:`Channel`); :func:`open_channel` picks one from the
address, once, and the connection never branches on it:

- :class:`ZmqChannel`: a ZeroMQ DEALER socket (``ipc:///path``, ``tcp://`` with CURVE).
- :class:`UnixChannel`: sonard's own Unix stream socket (``unix:///path``): every frame is a
  4-byte little-endian length and that many bytes; the first frame is the client's id, then
  each frame is one msgpack request (replies come back in order). The calling thread writes
  and reads the socket itself, so the kernel wakes each side where the other ran; ZeroMQ
  hands every message to and from its I/O threads, which on VMs whose idle CPUs halt costs
  tens of microseconds a hand-over (docs/benchmarks.md, "Placement").
"""

from __future__ import annotations

import errno
import os
import re
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from ._cpus import usable_cores
from ._liveness import Link, configure

# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

_HEADER = struct.Struct("<I")
# A unix:// server whose process stays stopped this long is given up (ZeroMQ's heartbeat
# timeout, _liveness.HEARTBEAT_TIMEOUT_MS); its state is read at most this often.
STOPPED_LIMIT_S = 5.0
STOPPED_CHECK_S = 0.25
# The most a reply frame may claim (the server's limit on a message, with room for its framing).
MAX_FRAME_BYTES = (4 << 20) + 1024


class ChannelError(RuntimeError):
    """The channel cannot carry a message (the connection, not the server's answer)."""


class Channel(Protocol):
    """The bytes of one client's messages to and from sonard."""

    def send(self, msg: bytes) -> None:
        """Queue or write one request."""

    def send_frames(self, frames: list[bytes]) -> None:
        """Send one message made of these parts, unchecked (tests of the server's input
        checks): a ZeroMQ multipart message; on unix://, one frame of the parts joined."""

    def recv(self, timeout: float) -> bytes | None:
        """The next reply's bytes, or None when none comes within timeout seconds (0: only one
        already there)."""

    def ready(self) -> bool:
        """A reply is waiting (recv(0) would return it)."""

    def lost(self, in_flight: int) -> str | None:
        """Why the connection to the server is given up, or None while it stands."""

    def close(self) -> None:
        """Release the socket."""


def client_id() -> bytes:
    """A fresh client id: after a reconnect (a network blip, ZeroMQ) the server finds the
    session again, within its grace period (hello's reconnect_grace_ms)."""
    return b"S" + os.urandom(15)


# How long a wait for a reply polls before it sleeps, while replies come that quickly
# (PollRule): sonard's own polling time, SONAR_SPIN, so one setting governs both ends.
DEFAULT_POLL_S = 50e-6
# Go's time.ParseDuration syntax, which sonard reads SONAR_SPIN with: "50us", "0.2ms", "1m30s".
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TERM = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
_TERMS = re.compile(_TERM)
_DURATION = re.compile(f"(?:{_TERM})+")


def poll_seconds(setting: str | None) -> float:
    """SONAR_SPIN's value in seconds: a duration as sonard's flags take it (``50us``,
    ``0.2ms``, ``0``); unset or empty is the default, a negative one is 0 (never poll). A value
    that is not a duration is an error, not a silent default."""
    if setting is None or not setting.strip():
        return DEFAULT_POLL_S
    text = setting.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    if not _DURATION.fullmatch(body):
        raise ValueError(f"SONAR_SPIN={setting!r} is not a duration such as 50us, 0.2ms or 0")
    return max(0.0, sign * sum(float(n) * _UNITS[unit] for n, unit in _TERMS.findall(body)))


def reply_poll_seconds() -> float:
    """How long a unix:// wait for a reply may poll: SONAR_SPIN's time, or 0 in a process that
    may run on one CPU only. Polling only helps where the server can answer on another CPU
    meanwhile; confined to one (taskset), the client does not poll, and sonard, which inherits
    the confinement of the process that starts it, neither."""
    return poll_seconds(os.environ.get("SONAR_SPIN")) if usable_cores() > 1 else 0.0


class PollRule:
    """Whether a wait for a reply polls before it sleeps: while replies come quickly.

    A thread asleep in a read is woken through its CPU, which on virtual machines whose idle
    CPUs halt costs tens of microseconds; one that polls finds the reply the moment it lands.
    So while each wait ended within ``poll`` seconds (a client calling a quick request in a
    loop, as a ping does), the next one first polls for up to ``poll`` seconds, yielding its
    CPU between reads to any thread that waits for it (the server's, if they share it); once a wait
    lasts longer (a reply that takes an update's time, as in training) the next one sleeps at
    once and costs no CPU, until a wait again ends within ``poll``. sonard follows the same
    rule for requests (its --spin). ``poll`` 0 never polls."""

    def __init__(self, poll: float) -> None:
        self.poll = poll
        self._cold = poll <= 0

    def until(self, start: float) -> float | None:
        """When a wait begun at ``start`` (time.perf_counter) stops polling; None: no poll."""
        return None if self._cold else start + self.poll

    def ended(self, start: float) -> None:
        """The wait begun at ``start`` has ended."""
        self._cold = self.poll <= 0 or time.perf_counter() - start > self.poll


def open_channel(address: str, timeout: float, server_gone: Callable[[], None]) -> Channel:
    """The channel for address (checked by the caller). server_gone raises when the private
    server this address belongs to has exited (a unix:// connect stops waiting then). On
    unix://, waits for replies poll first by PollRule, for SONAR_SPIN (the setting sonard
    polls by); ZeroMQ waits do not poll: libzmq's I/O threads sleep between messages whatever
    the caller does (ipc/unixpoll.go)."""
    if address.startswith("unix://"):
        return UnixChannel(address.removeprefix("unix://"), timeout, server_gone, PollRule(reply_poll_seconds()))
    return ZmqChannel(address)


class ZmqChannel:
    """One ZeroMQ DEALER socket, with heartbeats and a monitor (``_liveness``)."""

    def __init__(self, address: str) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, client_id())
        configure(self._sock)
        if address.startswith("tcp://"):
            self._use_curve()
        self._link = Link(self._sock)
        self._sock.connect(address)
        self._rcvtimeo = -1

    def _use_curve(self) -> None:
        """tcp:// servers authenticate clients with ZeroMQ CURVE (sonard --gen-curve-keys)."""
        server_pub = os.environ.get("SONAR_CURVE_SERVER_PUBLIC_FILE")
        prefix = os.environ.get("SONAR_CURVE_CLIENT_KEYS")
        if not server_pub or not prefix:
            raise ChannelError(
                "a tcp:// sonard requires CURVE keys: set SONAR_CURVE_SERVER_PUBLIC_FILE to the server's "
                "PREFIX.public and SONAR_CURVE_CLIENT_KEYS to the PREFIX of this client's key pair "
                "(both made by `sonard --gen-curve-keys PREFIX`)")

        def key(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read().strip()
        self._sock.curve_serverkey = key(server_pub)
        self._sock.curve_publickey = key(prefix + ".public")
        self._sock.curve_secretkey = key(prefix + ".secret")

    def send(self, msg: bytes) -> None:
        try:
            self._sock.send(msg, flags=_NOBLOCK)
        except zmq.Again:
            self._sock.send(msg)  # high-water mark reached: wait for the queue

    def send_frames(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames)

    def recv(self, timeout: float) -> bytes | None:
        if timeout <= 0:
            try:
                return self._sock.recv(_NOBLOCK)
            except zmq.Again:
                return None
        # A blocking receive with a timeout is one call into libzmq; a poll of the socket and
        # its monitor cost several more system calls and pyzmq's Python around them (4-13 us
        # of a ping's round trip, measured).
        ms = max(1, int(timeout * 1000))
        if ms != self._rcvtimeo:
            self._sock.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        try:
            return self._sock.recv()
        except zmq.Again:
            return None

    def ready(self) -> bool:
        return bool(int(self._sock.getsockopt(_EVENTS)) & _POLLIN)  # EVENTS is an int option

    def lost(self, in_flight: int) -> str | None:
        return self._link.lost(in_flight)

    def close(self) -> None:
        self._link.close()
        self._sock.close(linger=0)


class UnixChannel:
    """A Unix stream socket to a sonard listening on unix:///path.

    A server that exits or is killed closes the socket: the next read finds the end of the
    stream, and the replies it wrote before are still read first. There are no heartbeats
    (no I/O thread on either side to answer them); instead the server's process, known from
    the socket's peer credentials, is looked up in /proc: stopped (SIGSTOP, a debugger) for
    STOPPED_LIMIT_S, it is given up as ZeroMQ's heartbeat timeout would. A server that runs
    but never answers is found by the connection's request timeout, on either channel.

    A wait for a reply polls the socket without blocking first, by ``rule``."""

    def __init__(self, path: str, timeout: float, server_gone: Callable[[], None],
                 rule: PollRule | None = None) -> None:
        self._path = path
        self._rule = rule or PollRule(0.0)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray()
        self._pos = 0  # start of the first unread frame in _buf
        self._eof = False  # the server's end of the stream was read
        self._write_closed = False  # a write found the server's end closed
        self._timeout = timeout
        self._rcvtimeo = -1.0
        self._connect(timeout, server_gone)
        self.send(client_id())  # the first frame: who we are
        pid, _, _ = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        self._stat = f"/proc/{pid}/stat"
        self._checked = 0.0  # when /proc was last read
        self._stopped_since: float | None = None
        self.empty_polls = 0  # reads of a poll that found nothing (a count for tests and stats)

    def _connect(self, timeout: float, server_gone: Callable[[], None]) -> None:
        """Connect, waiting (up to timeout) for a server that has not bound its socket yet
        (a private server just started); server_gone raises when it exited meanwhile."""
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            try:
                self._sock.connect(self._path)
                return
            except (FileNotFoundError, ConnectionRefusedError) as e:
                server_gone()
                if time.monotonic() > deadline:
                    self._sock.close()
                    raise ChannelError(f"no sonard listening on unix://{self._path} within {timeout:.1f} s: {e}") from e
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            except OSError as e:  # not ours to reach (permissions), not a socket, ...
                self._sock.close()
                raise ChannelError(f"connecting to sonard at unix://{self._path}: {e}") from e

    def _write(self, data: bytes) -> None:
        """Write all of data; a server that reads nothing for the connection's timeout is an
        error, not a hang. Nothing is written once the server closed the connection."""
        if self._write_closed:
            return
        view = memoryview(data)
        deadline = 0.0
        while view:
            try:
                n = self._sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = 0
            except (BrokenPipeError, ConnectionResetError):
                # The server closed its end: like a message ZeroMQ queues for a peer that is
                # gone, this one is lost, and the wait for its reply finds the end of the stream
                # (and, for a private server, why it exited).
                self._write_closed = True
                return
            except OSError as e:
                raise ChannelError(f"writing to sonard (unix://{self._path}): {e}") from e
            view = view[n:]
            if view:
                now = time.monotonic()
                deadline = deadline or now + self._timeout
                if now > deadline:
                    raise ChannelError(f"sonard (unix://{self._path}) read nothing for {self._timeout:.1f} s")
                select.select([], [self._sock], [], min(0.05, deadline - now))

    def send(self, msg: bytes) -> None:
        self._write(_HEADER.pack(len(msg)) + msg)

    def send_frames(self, frames: list[bytes]) -> None:
        self.send(b"".join(frames))

    def _frame(self) -> bytes | None:
        """The next complete frame in the buffer, if any."""
        avail = len(self._buf) - self._pos
        if avail < 4:
            return None
        (n,) = _HEADER.unpack_from(self._buf, self._pos)
        if n > MAX_FRAME_BYTES:
            raise ChannelError(f"sonard (unix://{self._path}) sent a frame of {n} bytes: not a reply")
        if avail < 4 + n:
            return None
        start = self._pos + 4
        out = bytes(self._buf[start:start + n])
        self._pos = start + n
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > (1 << 16):
            del self._buf[:self._pos]
            self._pos = 0
        return out

    def _read(self, flags: int) -> bool:
        """One read into the buffer; False when nothing came (would block, or timed out)."""
        try:
            data = self._sock.recv(1 << 16, flags)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                self._eof = True
                return False
            raise ChannelError(f"reading from sonard (unix://{self._path}): {e}") from e
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def recv(self, timeout: float) -> bytes | None:
        frame = self._frame()
        if frame is not None or self._eof:
            return frame
        if timeout <= 0:
            while self._read(socket.MSG_DONTWAIT):
                if (frame := self._frame()) is not None:
                    return frame
            return None
        start = time.perf_counter()
        until = self._rule.until(start)
        if until is not None:
            frame = self._poll_for_frame(min(until, start + timeout))
            if frame is not None or self._eof:
                self._rule.ended(start)
                return frame
        frame = self._wait_for_frame(max(start + timeout - time.perf_counter(), 1e-6))
        self._rule.ended(start)
        return frame

    def _poll_for_frame(self, until: float) -> bytes | None:
        """A frame that arrives by perf_counter() time ``until``, read without blocking."""
        while True:
            if self._read(socket.MSG_DONTWAIT):
                if (frame := self._frame()) is not None:
                    return frame
            elif self._eof or time.perf_counter() >= until:
                return None
            else:
                self.empty_polls += 1
                os.sched_yield()

    def _wait_for_frame(self, timeout: float) -> bytes | None:
        """The next frame, sleeping in the socket's read for up to timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            # One system call: a blocking read bounded by SO_RCVTIMEO (set when it changes).
            left = max(deadline - time.monotonic(), 0.001)
            if abs(left - self._rcvtimeo) > 0.0005:
                sec = int(left)
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                      struct.pack("ll", sec, int((left - sec) * 1e6)))
                self._rcvtimeo = left
            got = self._read(0)
            if (frame := self._frame()) is not None:
                return frame
            if self._eof or (not got and time.monotonic() >= deadline):
                return None

    def ready(self) -> bool:
        if self._frame_ready():
            return True
        while self._read(socket.MSG_DONTWAIT):
            if self._frame_ready():
                return True
        return False

    def _frame_ready(self) -> bool:
        avail = len(self._buf) - self._pos
        return avail >= 4 and avail >= 4 + _HEADER.unpack_from(self._buf, self._pos)[0]

    def lost(self, in_flight: int) -> str | None:
        if self._eof and not self._frame_ready():
            return (f"the connection to sonard closed with {in_flight} requests in flight "
                    "(the server exited or was killed; a session is not resumed)")
        now = time.monotonic()
        if now - self._checked < STOPPED_CHECK_S:
            return None
        self._checked = now
        if not self._server_stopped():
            self._stopped_since = None
            return None
        self._stopped_since = self._stopped_since or now
        if now - self._stopped_since >= STOPPED_LIMIT_S:
            return (f"sonard's process has been stopped for {now - self._stopped_since:.1f} s with {in_flight} "
                    "requests in flight (SIGSTOP or a debugger; a session is not resumed)")
        return None

    def _server_stopped(self) -> bool:
        """The server's process is stopped (state T or t in /proc/PID/stat)."""
        try:
            with open(self._stat, "rb") as f:
                stat = f.read()
        except OSError:
            return False  # gone: the socket's end of stream says so
        return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")

    def close(self) -> None:
        self._sock.close()

