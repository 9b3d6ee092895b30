"""The connection to sonard: one channel (``_channel``: ZeroMQ, or sonard's own Unix socket)
speaking the msgpack protocol (docs/protocol.md), pipelined requests matched to their replies
by id."""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgpack

from . import _fork
from ._channel import Channel, ChannelError, open_channel
from ._openmp import DirectWait, Waiter

PROTOCOL_VERSION = 1
# The most tensors one register, step or discard request may name (ipc.MaxItems): a longer list
# goes in several requests (register stages all but the last: all or none).
MAX_ITEMS = 4096
# At most this many requests wait for their replies: past it, send() reads replies first
# (the server also parks a client's requests while its replies wait: docs/protocol.md).
MAX_IN_FLIGHT = 512

# Once the private server has exited, how long the client still reads for replies it sent
# before exiting (they are already in the socket; ZeroMQ's I/O thread moves them).
EXIT_GRACE_S = 0.25
# How often send() asks the monitor whether the connection dropped (a system call): a drop in
# between is still seen before any reconnection (ZeroMQ waits 100 ms to reconnect), by wait()'s
# link check when no reply comes.
LINK_CHECK_S = 0.01

# How many of the latest requests' latencies and traces a connection keeps: a long run sends
# millions of requests, and an unbounded list would grow with each.
RECENT_REQUESTS = 1 << 16

log = logging.getLogger("sonar_moe")

_T = TypeVar("_T")


def in_requests(items: list[_T]) -> list[list[_T]]:
    """items in pieces of at most MAX_ITEMS, in order, one a request (one piece when empty)."""
    return [items[i:i + MAX_ITEMS] for i in range(0, max(len(items), 1), MAX_ITEMS)]


class SonarError(RuntimeError):
    """The server refused a request, or could not be reached."""


class SonarServerDied(SonarError):
    """The private sonard process exited. The message's first line says why (its exit status
    and the cause its log names); ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


# sonard's exit statuses (sonard --help).
EXIT_RUNTIME_FAILURE = 1
EXIT_CRASH = 2
EXIT_BAD_FLAGS = 64

# Lines of a Go runtime crash that name its cause, in the order they are reported.
_CRASH_LINES = re.compile(
    r"^(fatal error: .*|panic: .*|unexpected fault address .*|\[signal [A-Z]+: [^\]]*\]|SIG[A-Z]+: .*)$", re.M)


def death_cause(returncode: int, log: str) -> str:
    """One line saying why sonard exited, from its exit status and its log."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if name == "SIGKILL" else ""
        return f"sonard exited: killed by {name}{hint}"
    if returncode == EXIT_CRASH:
        found = _CRASH_LINES.findall(log)
        cause = "; ".join(dict.fromkeys(line.strip() for line in found[:4])) or "no cause in its log"
        return f"sonard exited: crashed (status 2, a Go runtime error, a bug of sonard): {cause}"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "ERROR" in ln or ln.startswith("sonard:")]
    last = (errors or lines or ["its log is empty"])[-1]
    if returncode == EXIT_RUNTIME_FAILURE:
        return f"sonard exited: runtime failure (status 1): {last}"
    if returncode == EXIT_BAD_FLAGS:
        return f"sonard exited: bad flags (status 64): {last}"
    return f"sonard exited with status {returncode}: {last}"


class SonarRefused(SonarError):
    """The server answered a request with an error."""


LOCAL_SCHEMES = ("ipc://", "unix://")  # a server on this machine (its clock, its processes)


def check_address(address: str) -> None:
    """The transports a client speaks: ipc:///path and unix:///path (local), and tcp://
    (always with CURVE)."""
    if address.startswith(("ipc:///", "unix:///", "tcp://")):
        return
    raise SonarError(f"sonard address {address!r}: only ipc:///path, unix:///path and tcp://host:port (with CURVE) "
                     "are allowed; other transports (ws://, inproc://, ipc://@abstract, ...) do not authenticate "
                     "the server's peers")


def is_local(address: str) -> bool:
    """The server runs on this machine (a Unix socket address)."""
    return address.startswith(LOCAL_SCHEMES)


@dataclass
class Pending:
    op: str
    sent: float
    on_reply: Callable[[dict[str, Any]], None] | None
    reply: dict[str, Any] | None = None
    start_ns: int = 0  # CLOCK_MONOTONIC before the request was packed
    sent_ns: int = 0  # and once the socket took it


class RequestTrace(NamedTuple):
    """Where one request's round trip went: CLOCK_MONOTONIC readings in nanoseconds, the
    client's and (from the reply's ``t``) the server's, which share the clock on one machine."""

    op: str
    start: int  # client: before packing the request
    sent: int  # client: the send call returned (on a busy machine, possibly after `received`)
    received: int  # server: received
    decoded: int  # server: decoded
    handled: int  # server: handled (the reply is encoded and sent next)
    got: int  # client: the reply's bytes came out of the socket
    woke: int  # client: the wait returned (torch's parked threads woken)
    done: int  # client: the reply handled (callbacks run)
    server_us: int  # a step's own time in the server (validation and update), else 0

    def segments(self) -> dict[str, float]:
        """The round trip cut where the hand-overs are, in microseconds."""
        return {"client_send": (self.sent - self.start) / 1e3, "to_server": (self.received - self.sent) / 1e3,
                "decode": (self.decoded - self.received) / 1e3, "handle": (self.handled - self.decoded) / 1e3,
                "to_client": (self.got - self.handled) / 1e3, "wake": (self.woke - self.got) / 1e3,
                "dispatch": (self.done - self.woke) / 1e3, "total": (self.done - self.start) / 1e3}

    @staticmethod
    def median_segments(traces: list[RequestTrace]) -> dict[str, float]:
        """The median of each segment over traces (us); empty without traces."""
        segs = [t.segments() for t in traces]
        return {k: statistics.median(x[k] for x in segs) for k in segs[0]} if segs else {}


@dataclass
class Connection:
    """One channel to sonard. Requests are pipelined; replies are matched by id."""

    address: str
    timeout: float = 30.0
    process: subprocess.Popen[bytes] | None = None
    log_path: str | None = None
    admin_token: str | None = None  # the private server's owner token (shutdown)
    _chan: Channel = field(init=False)
    _ids: itertools.count[int] = field(init=False, default_factory=lambda: itertools.count(1))
    _pending: dict[int, Pending] = field(init=False, default_factory=dict)
    _done: dict[int, dict[str, Any]] = field(init=False, default_factory=dict)
    _closed: bool = field(init=False, default=False)
    _forked_from: int | None = field(init=False, default=None)
    _link_checked: float = field(init=False, default=-1e9)  # monotonic time of send's last link check
    _local: bool = field(init=False, default=False)  # the server shares this machine's clock (traces)
    # Requests whose send an exception interrupted (Ctrl-C): sent or not, nobody knows (_resolve_unsure).
    _unsure: set[int] = field(init=False, default_factory=set)
    # The latest requests' latencies (seconds, send to reply handled) and, where the server
    # shares this machine's clock (ipc://, unix://), their traces.
    latencies: deque[float] = field(init=False, default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    traces: deque[RequestTrace] = field(init=False, default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    _got_ns: int = field(init=False, default=0)  # when _recv last returned a reply's bytes
    # Replies received and not yet handled, with when their bytes came: a signal handler that
    # waits on this connection (a checkpoint saved from SIGTERM's handler) while the code it
    # interrupted holds a reply it received handles that reply first instead of waiting for it.
    _inbox: deque[tuple[bytes, int]] = field(init=False, default_factory=deque)
    answered: int = field(init=False, default=0)  # replies handled since the connection opened
    # How a blocking receive waits: the backend that knows torch's threads sets it
    # (_openmp.choose_waiter); direct by default.
    waiter: Waiter = field(init=False, default_factory=DirectWait)

    def __post_init__(self) -> None:
        check_address(self.address)
        self._local = is_local(self.address)
        try:
            self._chan = open_channel(self.address, self.timeout, self.check_alive)
        except ChannelError as e:
            raise SonarError(str(e)) from e
        _fork.track(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the connection, the private server and its run directory
        belong to the parent. Forget them; never speak on the socket (_fork)."""
        self._forked_from = os.getppid()
        self._closed = True
        self._pending.clear()
        self._done.clear()
        self._inbox.clear()

    def _check_process(self) -> None:
        if self._forked_from is not None:
            raise SonarError(
                f"this SonarAdamW belongs to process {self._forked_from}; a forked child cannot use it (its "
                "server session, shared memory and private sonard are the parent's). Build a new SonarAdamW "
                "in the child, or use the spawn start method")

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def send(self, op: str, body: dict[str, Any], on_reply: Callable[[dict[str, Any]], None] | None = None) -> int:
        """Send a request without waiting; on_reply(reply) runs when its reply arrives."""
        self._check_process()
        while len(self._pending) >= MAX_IN_FLIGHT:
            self.wait_any()
        now = time.monotonic()
        if now - self._link_checked >= LINK_CHECK_S:
            self._check_link()
            self._link_checked = now
        start = time.monotonic_ns()
        rid = next(self._ids)
        msg = msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": rid, "body": body}, use_bin_type=True)
        p = self._pending[rid] = Pending(op, time.perf_counter(), on_reply, start_ns=start)
        try:
            self._chan.send(msg)
        except ChannelError as e:
            self._pending.pop(rid, None)
            self.check_alive()
            raise SonarServerDied(f"{e}: {self.address}") from e
        except BaseException:
            # An interrupt (KeyboardInterrupt, a signal handler's exception) before or just after
            # the message went out: its reply may never come. The next wait finds out.
            self._unsure.add(rid)
            raise
        p.sent_ns = time.monotonic_ns()
        return rid

    def _resolve_unsure(self) -> None:
        """Requests whose send was interrupted either reached sonard or not. A session's
        requests run, and are answered, in the order they arrive, so once a ping sent now is
        answered, any of them still unanswered never arrived: each gets an error reply of its
        own (its update not made), and nothing waits for it until the timeout."""
        if not self._unsure:
            return
        unsure, self._unsure = set(self._unsure), set()

        def settle(rep: dict[str, Any]) -> None:
            for rid in sorted(unsure):
                p = self._pending.pop(rid, None)
                if p is None:
                    continue  # it was sent, and answered
                lost = {"v": PROTOCOL_VERSION, "id": rid, "ok": False,
                        "error": f"{p.op} request {rid} was interrupted before sonard received it: not executed"}
                if p.on_reply is not None:
                    p.on_reply(lost)
                else:
                    self._done[rid] = lost

        self.send("ping", {}, settle)

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (tests of the server's input checks)."""
        self._chan.send_frames(frames)

    def recv_raw(self, timeout: float) -> dict[str, Any]:
        """Receive one reply without matching it (tests)."""
        raw = self._chan.recv(timeout)
        if raw is None:
            raise TimeoutError("no reply from sonard")
        return msgpack.unpackb(raw, raw=False)

    def call(self, op: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send a request and wait for its reply; raise SonarError if it failed."""
        rid = self.send(op, body)
        rep = self.wait(rid, timeout)
        if not rep.get("ok"):
            raise SonarRefused(f"sonard refused {op}: {rep.get('error')}")
        return rep.get("body") or {}

    def poll(self, timeout: float = 0.0) -> int:
        """Handle the replies that arrive within timeout seconds; return how many.

        With a timeout, the hot path costs one receive (it returns at once when a reply is
        already waiting), then one EVENTS check for more when other requests are pending;
        without one, the EVENTS checks and the receives they find."""
        self._check_process()
        if timeout <= 0:
            return self._drain()
        # One blocking receive (the channel's); a closed connection is seen by the caller's
        # link check when the timeout passes (every 50 ms in wait()).
        if self.waiter.receive(self._recv, timeout) is None and not self._inbox:
            return 0
        n = self._dispatch_inbox(time.monotonic_ns())
        # A reply to nothing pending would be refused anyway; with nothing pending (a request that
        # was waited for), asking the socket for more costs a system call for nothing.
        return n + (self._drain() if self._pending else 0)

    def _recv(self, timeout: float) -> bytes | None:
        """The next reply's bytes, or None when none comes within timeout seconds (0: only one
        already there). Called by the waiter, on the thread it chooses."""
        try:
            raw = self._chan.recv(timeout)
        except ChannelError as e:
            raise SonarError(f"{e}: {self.address}") from e
        if raw is None:
            return None
        self._got_ns = time.monotonic_ns()
        self._inbox.append((raw, self._got_ns))
        return raw

    def _dispatch_inbox(self, woke: int = 0) -> int:
        """Handle the replies received and not handled yet; how many."""
        n = 0
        while self._inbox:
            raw, got = self._inbox.popleft()
            self._dispatch(raw, got, woke or got)
            n += 1
        return n

    def _drain(self) -> int:
        """Handle every reply already in the socket."""
        n = self._dispatch_inbox()
        while self._chan.ready():
            if self._recv(0.0) is None:
                break
            n += self._dispatch_inbox()
        return n

    def wait(self, rid: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Wait for reply rid (or for every pending reply when rid is None)."""
        self._resolve_unsure()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while (rid is None and self._pending) or (rid is not None and rid in self._pending):
            if time.monotonic() > deadline:
                ops = sorted({p.op for p in self._pending.values()})
                raise SonarError(f"sonard did not answer within {limit:.1f} s ({len(self._pending)} requests pending: {ops})")
            n = self._poll_or_raise_if_gone(0.05)
            # The link is checked only while the awaited reply is missing (a shutdown's comes before
            # the server leaves) and the private server, if any, still runs: once it has exited,
            # _poll_or_raise_if_gone reads what it sent first.
            if not n and self.server_alive and ((rid is None and self._pending) or
                                                (rid is not None and rid in self._pending)):
                self._check_link()
        if rid is None:
            return {}
        return self._done.pop(rid)

    def wait_any(self, timeout: float | None = None) -> None:
        """Wait until at least one reply has been handled."""
        self._resolve_unsure()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._poll_or_raise_if_gone(0.05):
            if self.server_alive:
                self._check_link()
            if time.monotonic() > deadline:
                raise SonarError(f"sonard did not answer within {limit:.1f} s ({len(self._pending)} requests pending)")

    def _poll_or_raise_if_gone(self, timeout: float) -> int:
        """poll(timeout); raise SonarServerDied only when the private server had already exited
        before a poll that found nothing. A reply that arrives is handled without asking about
        the process. When none did, liveness is sampled first and the socket read after, so a
        reply the server sent just before exiting (a shutdown's) is always read, never mistaken
        for a death; ZeroMQ's I/O thread gets EXIT_GRACE_S to hand such a reply over."""
        n = self.poll(timeout)
        if n or self.server_alive:
            return n
        n = self.poll(EXIT_GRACE_S)
        if not n:
            self.check_alive()
        return n

    @property
    def server_alive(self) -> bool:
        """False once the private server process has exited (a shared server is not watched)."""
        return self.process is None or self.process.poll() is None

    def _check_link(self) -> None:
        """Raise SonarServerDied when the connection to the server is lost (the private
        server's exit code and log when it was the private one)."""
        why = self._chan.lost(len(self._pending))
        if why is None:
            return
        if self.process is not None:
            try:
                self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            self.check_alive()
        raise SonarServerDied(f"{why}: {self.address}")

    def check_alive(self) -> None:
        """Raise SonarServerDied, naming the cause in one line, if the private server has exited."""
        if not self.server_alive:
            assert self.process is not None
            text = self._read_log()
            tail = text[-2000:].strip()
            if tail:
                log.debug("sonard's log ends:\n%s", tail)
            cause = death_cause(self.process.returncode, text)
            steps = sum(1 for p in self._pending.values() if p.op == "step")
            if steps:
                cause += (f"; {steps} expert update request(s) were in flight: their expert tensors may be partly "
                          "updated (restore the model from a checkpoint before using it)")
            raise SonarServerDied(cause, tail)

    def _read_log(self) -> str:
        """The end of the private server's log (a crash's goroutine dump can be long: 4 MiB)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (4 << 20)))
            return f.read().decode(errors="replace")

    def _dispatch(self, raw: bytes, got: int = 0, woke: int = 0) -> None:
        """Handle one reply whose bytes came at ``got`` (monotonic ns) and whose wait ended at
        ``woke``."""
        try:
            rep = msgpack.unpackb(raw, raw=False)
        except Exception as e:  # noqa: BLE001 - a broken reply is a server bug
            raise SonarError(f"malformed reply from sonard: {e}") from e
        if not isinstance(rep, dict):
            raise SonarError(f"malformed reply from sonard: {type(rep).__name__}")
        if rep.get("v") != PROTOCOL_VERSION:
            raise SonarError(f"sonard speaks protocol {rep.get('v')}, this client speaks {PROTOCOL_VERSION}")
        rid = rep.get("id")
        p = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if p is None or not isinstance(rid, int):
            raise SonarError(f"reply to unknown request {rid}: {rep.get('error')}")
        self.latencies.append(time.perf_counter() - p.sent)
        self.answered += 1
        if p.on_reply is not None:
            p.on_reply(rep)
        else:
            self._done[rid] = rep
        self._trace(p, rep, got, woke)

    def _trace(self, p: Pending, rep: dict[str, Any], got: int, woke: int) -> None:
        """Keep the request's trace where the server's readings share this machine's clock."""
        t = rep.get("t")
        if not (got and self._local and type(t) is list and len(t) == 3):
            return
        t0, t1, t2 = t
        if not (type(t0) is int and type(t1) is int and type(t2) is int):
            return
        body = rep.get("body")
        micros = body.get("micros", 0) if p.op == "step" and isinstance(body, dict) else 0
        self.traces.append(RequestTrace(p.op, p.start_ns, p.sent_ns, t0, t1, t2, got, woke,
                                        time.monotonic_ns(), micros if isinstance(micros, int) else 0))

    def close(self) -> None:
        self._closed = True
        if self._forked_from is not None:
            return  # the parent's sockets: never touched in a forked child
        self._chan.close()

    def shutdown(self, timeout: float = 5.0) -> None:
        """End the session: a private server is told to shut down, waited for and its run
        directory (socket, log) removed; a shared server is told goodbye. Closes the socket.
        A private server that has already exited is not spoken to; a closed connection is left alone."""
        if self._closed:
            return
        try:
            if self.server_alive:
                self._say_goodbye(timeout)
        finally:
            if self.process is not None:
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
                if self.log_path:
                    shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)
            self.close()

    def _say_goodbye(self, timeout: float) -> None:
        """shutdown (private server) or bye (shared server). A private server that exits with
        code 0 before its reply is read has done what was asked: that is not an error."""
        if self.process is None:
            self.call("bye", {}, timeout=timeout)
            return
        try:
            self.call("shutdown", {"token": self.admin_token or ""}, timeout=timeout)
        except SonarServerDied:
            if self.process.returncode != 0:
                raise
            log.debug("sonard exited cleanly before its shutdown reply was read")

    def end_session(self) -> None:
        """shutdown(), best effort (at close or exit): a failure is logged, not raised."""
        try:
            self.shutdown()
        except Exception as e:  # noqa: BLE001
            log.warning("sonard did not acknowledge the goodbye: %s", e)
