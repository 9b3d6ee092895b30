"""One client must not crash or exhaust a shared sonard: segments and connections are capped
from the process's RLIMIT_NOFILE, error replies and log lines clip what the client sent, a
unix:// frame's memory is taken as its bytes arrive, and a ZeroMQ message of many frames is
refused without being held. Each test starts its own sonard (under prlimit where a small fd
limit makes the point quickly) and speaks the wire protocol directly."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

TRANSPORTS = ["ipc", "unix"]
BIG = "A" * (4 * 1024 * 1024 - 256)  # a request string near the 4 MiB message limit


class Server:
    def __init__(self, binary: str, tmp: Path, transport: str, nofile: int | None, extra: tuple[str, ...] = ()) -> None:
        run = tmp / "r"
        run.mkdir(mode=0o700, parents=True)
        self.sock = run / "s.sock"
        self.addr = f"{transport}://{self.sock}"
        self.log = tmp / "sonard.log"
        prefix: list[str] = []
        if nofile is not None:
            if not shutil.which("prlimit"):
                pytest.skip("no prlimit")
            prefix = ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*prefix, binary, "--listen", self.addr, "--cuda-device", "-1", *extra],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "sonard did not listen"
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture()
def start(sonard_binary: str, tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def _start(transport: str, nofile: int | None = None, extra: tuple[str, ...] = ()) -> Server:
        s = Server(sonard_binary, tmp_path / f"s{len(servers)}", transport, nofile, extra)
        servers.append(s)
        return s

    yield _start
    for s in servers:
        assert s.stop() == 0, s.log.read_text()[-2000:]


_ids = iter(range(1, 1 << 30))


def request(op: str, body: Any = None) -> bytes:
    m: dict[str, Any] = {"v": 1, "op": op, "id": next(_ids)}
    if body is not None:
        m["body"] = body
    return msgpack.packb(m, use_bin_type=True)


class Client:
    """A raw client of either transport: send() a request, recv() its reply (raw bytes)."""

    def __init__(self, addr: str) -> None:
        self.unix = addr.startswith("unix://")
        if self.unix:
            self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.s.settimeout(10)
            self.s.connect(addr[len("unix://"):])
            ident = secrets.token_bytes(8)
            self.s.sendall(struct.pack("<I", len(ident)) + ident)
        else:
            self.ctx = zmq.Context()
            self.z = self.ctx.socket(zmq.DEALER)
            self.z.setsockopt(zmq.LINGER, 0)
            self.z.connect(addr)

    def send(self, raw: bytes) -> None:
        if self.unix:
            self.s.sendall(struct.pack("<I", len(raw)) + raw)
        else:
            self.z.send(raw)

    def _read(self, n: int) -> bytes:
        b = b""
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                raise EOFError("closed by the server")
            b += c
        return b

    def recv(self, timeout: float = 10) -> bytes:
        if self.unix:
            self.s.settimeout(timeout)
            return self._read(struct.unpack("<I", self._read(4))[0])
        if not self.z.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        return self.z.recv()

    def call(self, op: str, body: Any = None, timeout: float = 10) -> dict[str, Any]:
        self.send(request(op, body))
        return msgpack.unpackb(self.recv(timeout), raw=False)

    def close(self) -> None:
        if self.unix:
            self.s.close()
        else:
            self.z.close(0)
            self.ctx.term()


def tiny_segment(tag: str) -> str:
    name = f"sonar-limits-{os.getpid()}-{tag}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, 4096)
    finally:
        os.close(fd)
    return name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_segments_are_capped_and_the_server_keeps_accepting(start: Any, transport: str) -> None:
    """With 256 fds, one session may attach 24 segments (fdlimit.Choose): the next attach is
    refused with a clear error, and other clients still connect and attach."""
    srv = start(transport, nofile=256)
    hog = Client(srv.addr)
    refused = None
    for i in range(300):
        name = tiny_segment(f"hog{i}")
        rep = hog.call("attach", {"shm": name, "size": 4096})
        if not rep["ok"]:
            os.unlink(f"/dev/shm/{name}")
            refused = (i, rep["error"])
            break
    assert refused is not None, "300 segments attached by one session under a 256-fd limit"
    assert refused[0] == 24 and "too many segments attached: 24 by this session (limit 24 a session)" in refused[1], refused
    other = Client(srv.addr)
    assert other.call("ping")["ok"]
    rep = other.call("attach", {"shm": tiny_segment("other"), "size": 4096})
    assert rep["ok"], rep
    assert "limits from RLIMIT_NOFILE" in srv.log.read_text()
    hog.close()
    other.close()
    assert srv.alive()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_connections_do_not_kill_the_server(start: Any, transport: str) -> None:
    """300 connections to a sonard with 256 fds (96 allowed): those past the bound are closed,
    the server lives, serves its first client throughout, and accepts again once they close."""
    srv = start(transport, nofile=256)
    first = Client(srv.addr)
    assert first.call("ping")["ok"]
    conns: list[Any] = []
    if transport == "unix":
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(srv.sock))
            conns.append(s)
    else:
        ctx = zmq.Context()
        for _ in range(300):
            z = ctx.socket(zmq.DEALER)
            z.setsockopt(zmq.LINGER, 0)
            z.connect(srv.addr)
            z.send(request("ping"))
            conns.append(z)
            time.sleep(0.002)
    time.sleep(1)
    assert srv.alive(), srv.log.read_text()[-2000:]
    assert first.call("ping")["ok"]
    for c in conns:
        c.close()
    if transport == "ipc":
        ctx.term()
    time.sleep(1)
    late = Client(srv.addr)
    assert late.call("ping")["ok"]
    assert "too many connections" in srv.log.read_text()
    late.close()
    first.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_replies_and_logs_clip_client_values(start: Any, transport: str) -> None:
    srv = start(transport)
    c = Client(srv.addr)
    for op, body in [(BIG, None), ("attach", {"shm": BIG, "size": 1}), ("hello", {"sqrt_lib": BIG}),
                     ("register", {"tensors": [{"name": "a", "shape": [1], "dtype": BIG,
                                                "param": {"seg": 1, "off": 0, "nbytes": 4}, "hyper": {}}]})]:
        c.send(request(op, body))
        raw = c.recv()
        rep = msgpack.unpackb(raw, raw=False)
        assert not rep["ok"] and "bytes)" in rep["error"], rep["error"][:300]
        assert len(raw) < 2048, f"{op[:20]}: reply of {len(raw)} bytes"
    size = srv.log.stat().st_size
    assert c.call("hello", {"client": BIG})["ok"]
    time.sleep(0.2)
    assert srv.log.stat().st_size - size < 4096, "a 4 MiB client name went to the log"
    c.close()


def heap_mib(srv: Server) -> float:
    """The server's Go heap in use (its Prometheus metrics): the process's VmSize also counts
    thread stacks and malloc arenas, which vary by hundreds of MiB between runs."""
    m = re.search(r"metrics\s.*url.*?(http://[0-9.:]+/metrics)", srv.log.read_text())
    assert m, srv.log.read_text()
    text = urllib.request.urlopen(m.group(1), timeout=10).read().decode()
    v = re.search(r"^go_memstats_heap_inuse_bytes (\S+)$", text, re.M)
    assert v, text[:500]
    return float(v.group(1)) / (1 << 20)


def test_unix_header_only_frames_take_no_memory(start: Any) -> None:
    """100 connections that announce a 4 MiB frame and send nothing more took 400 MiB before
    (the frame was allocated at its header); now each takes at most a chunk."""
    srv = start("unix", extra=("--metrics-addr", "127.0.0.1:0"))
    good = Client(srv.addr)
    assert good.call("ping")["ok"]
    before = heap_mib(srv)
    conns = []
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(srv.sock))
        ident = secrets.token_bytes(8)
        s.sendall(struct.pack("<I", 8) + ident + struct.pack("<I", 4 << 20))
        conns.append(s)
    time.sleep(1)
    grown = heap_mib(srv) - before
    assert grown < 100, f"the heap grew {grown:.0f} MiB for 100 header-only frames"
    assert good.call("ping")["ok"]
    for s in conns:
        s.close()
    good.close()


def test_zmq_message_of_many_frames_is_refused(start: Any) -> None:
    srv = start("ipc")
    c = Client(srv.addr)
    frame = b"\0" * (1 << 20)
    for _ in range(20):
        c.z.send(frame, zmq.SNDMORE)
    c.z.send(request("ping"))
    rep = msgpack.unpackb(c.recv(), raw=False)
    assert not rep["ok"] and "message of 22 frames" in rep["error"], rep
    assert c.call("ping")["ok"]
    c.close()
