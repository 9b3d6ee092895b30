"""The connection to sonard: a ZeroMQ DEALER socket speaking the msgpack protocol
(docs/protocol.md), and the private server process when the client starts one."""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch
import zmq

PROTOCOL_VERSION = 1


class SonarError(RuntimeError):
    """The server refused a request, or could not be reached."""


class SonarServerDied(SonarError):
    """The private sonard process exited."""


def find_sonard() -> str:
    """The server binary: $SONARD, then the repository's bin/sonard, then the one installed
    with the wheel (sonar_moe/bin/sonard), then PATH."""
    env = os.environ.get("SONARD")
    if env:
        if not os.access(env, os.X_OK):
            raise SonarError(f"$SONARD={env!r} is not an executable file")
        return env
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "bin" / "sonard", here / "bin" / "sonard"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("sonard")
    if found:
        return found
    raise SonarError("sonard not found: set $SONARD, run `make build` (bin/sonard), or put sonard on PATH")


@dataclass
class Pending:
    op: str
    sent: float
    on_reply: Callable[[dict[str, Any]], None] | None
    reply: dict[str, Any] | None = None


@dataclass
class Connection:
    """One DEALER socket to sonard. Requests are pipelined; replies are matched by id."""

    address: str
    timeout: float = 30.0
    process: subprocess.Popen[bytes] | None = None
    log_path: str | None = None
    _ctx: zmq.Context[Any] = field(init=False)
    _sock: zmq.Socket[Any] = field(init=False)
    _ids: itertools.count[int] = field(init=False, default_factory=lambda: itertools.count(1))
    _pending: dict[int, Pending] = field(init=False, default_factory=dict)
    _done: dict[int, dict[str, Any]] = field(init=False, default_factory=dict)
    latencies: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.address.startswith("tcp://"):
            self._use_curve()
        self._sock.connect(self.address)

    def _use_curve(self) -> None:
        """tcp:// servers authenticate clients with ZeroMQ CURVE (sonard --gen-curve-keys)."""
        server_pub = os.environ.get("SONAR_CURVE_SERVER_PUBLIC_FILE")
        prefix = os.environ.get("SONAR_CURVE_CLIENT_KEYS")
        if not server_pub or not prefix:
            raise SonarError(
                "a tcp:// sonard requires CURVE keys: set SONAR_CURVE_SERVER_PUBLIC_FILE to the server's "
                "PREFIX.public and SONAR_CURVE_CLIENT_KEYS to the PREFIX of this client's key pair "
                "(both made by `sonard --gen-curve-keys PREFIX`)")
        def key(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read().strip()
        self._sock.curve_serverkey = key(server_pub)
        self._sock.curve_publickey = key(prefix + ".public")
        self._sock.curve_secretkey = key(prefix + ".secret")

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def send(self, op: str, body: dict[str, Any], on_reply: Callable[[dict[str, Any]], None] | None = None) -> int:
        """Send a request without waiting; on_reply(reply) runs when its reply arrives."""
        rid = next(self._ids)
        msg = msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": rid, "body": body}, use_bin_type=True)
        self._pending[rid] = Pending(op, time.perf_counter(), on_reply)
        try:
            self._sock.send(msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._sock.send(msg)  # high-water mark reached: wait for the queue
        return rid

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (tests of the server's input checks)."""
        self._sock.send_multipart(frames)

    def recv_raw(self, timeout: float) -> dict[str, Any]:
        """Receive one reply without matching it (tests)."""
        if not self._sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply from sonard")
        return msgpack.unpackb(self._sock.recv(), raw=False)

    def call(self, op: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send a request and wait for its reply; raise SonarError if it failed."""
        rid = self.send(op, body)
        rep = self.wait(rid, timeout)
        if not rep.get("ok"):
            raise SonarError(f"sonard refused {op}: {rep.get('error')}")
        return rep.get("body") or {}

    def poll(self, timeout: float = 0.0) -> int:
        """Handle the replies that arrive within timeout seconds; return how many."""
        n = 0
        wait_ms = int(timeout * 1000)
        while self._sock.poll(wait_ms):
            self._dispatch(self._sock.recv())
            n += 1
            wait_ms = 0
        return n

    def wait(self, rid: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Wait for reply rid (or for every pending reply when rid is None)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while (rid is None and self._pending) or (rid is not None and rid in self._pending):
            if time.monotonic() > deadline:
                ops = sorted({p.op for p in self._pending.values()})
                raise SonarError(f"sonard did not answer within {limit:.1f} s ({len(self._pending)} requests pending: {ops})")
            self.check_alive()
            self.poll(0.05)
        if rid is None:
            return {}
        return self._done.pop(rid)

    def wait_any(self, timeout: float | None = None) -> None:
        """Wait until at least one reply has been handled."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.poll(0.05):
            self.check_alive()
            if time.monotonic() > deadline:
                raise SonarError(f"sonard did not answer within {limit:.1f} s ({len(self._pending)} requests pending)")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise SonarServerDied(f"sonard exited with code {self.process.returncode}{self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace").strip()
        return f"; its log ends:\n{tail}" if tail else ""

    def _dispatch(self, raw: bytes) -> None:
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
        if p is None:
            raise SonarError(f"reply to unknown request {rid}: {rep.get('error')}")
        self.latencies.append(time.perf_counter() - p.sent)
        if p.on_reply is not None:
            p.on_reply(rep)
        else:
            self._done[rid] = rep

    def close(self) -> None:
        self._sock.close(linger=0)

    def shutdown(self, timeout: float = 5.0) -> None:
        """End the session: a private server is told to shut down, waited for and its run
        directory (socket, log) removed; a shared server is told goodbye. Closes the socket."""
        try:
            self.call("shutdown" if self.process is not None else "bye", {}, timeout=timeout)
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


VML_HA_MODE = 0x2 | 0x140000 | 0x100  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as ATen calls MKL


@functools.cache
def torch_sqrt_library() -> str | None:
    """The library whose float32 sqrt torch uses, when it is not the IEEE one.

    On x86, ATen computes float32 ``sqrt`` with MKL's ``vmsSqrt`` (high-accuracy mode),
    linked into libtorch_cpu.so; on AVX-512 machines about 0.6% of its results are one
    ulp below the IEEE square root. Returns that library's path when ``vmsSqrt`` is
    exported and reproduces ``torch.sqrt`` on a probe; None otherwise.
    """
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(lib).vmsSqrt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    probe = _sqrt_probe()
    out = torch.empty_like(probe)
    fn(probe.numel(), probe.data_ptr(), out.data_ptr(), VML_HA_MODE)
    return lib if torch.equal(out, torch.sqrt(probe)) else None


def torch_sqrt_is_ieee() -> bool:
    """Whether torch's float32 sqrt is correctly rounded on the probe."""
    probe = _sqrt_probe()
    return torch.equal(torch.sqrt(probe), torch.sqrt(probe.double()).float())


@functools.cache
def _sqrt_probe() -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    mant = torch.rand(1 << 18, generator=g) + 0.5
    exps = torch.randint(-60, 20, (1 << 18,), generator=g).float()
    return (mant * torch.exp2(exps)).contiguous()


def start_private_server(timeout: float, log_level: str = "warn") -> Connection:
    """Start a sonard for this process on an ipc:// socket in a fresh 0700 directory."""
    binary = find_sonard()
    rundir = tempfile.mkdtemp(prefix="sonar-")  # mode 0700
    sock = os.path.join(rundir, "sonard.sock")
    log_path = os.path.join(rundir, "sonard.log")
    args = [binary, "--listen", f"ipc://{sock}", "--log-level", log_level]
    lib = torch_sqrt_library()
    if lib:
        args += ["--torch-lib", lib]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the trainer reaches the trainer; close() stops the server
        )
    return Connection(address=f"ipc://{sock}", timeout=timeout, process=proc, log_path=log_path)
