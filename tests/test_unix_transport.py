"""sonard's own Unix socket transport (unix:///path, issue 15 item 3) against a real sonard:
training through it is bitwise torch's, a shared server serves several clients and survives
raw bad input, a dead or stopped server is an error within seconds, never a hang; the private
server speaks it when SONAR_TRANSPORT=unix. (The whole suite also runs with SONAR_TRANSPORT=unix
in `make test-unix`.)"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar_moe
from conftest import server_stats, sonard_command
from lifetime_util import stop
from moe_util import TinyMoE, assert_same_params, train_beside
from sonar_moe import Connection, SonarError, SonarServerDied
from sonar_moe._channel import PollRule, UnixChannel, poll_seconds, reply_poll_seconds
from sonar_moe._launch import start_private_server


@pytest.fixture()
def unix_server(sonard_binary: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A shared sonard on a unix:// socket; its address and process."""
    path = tmp_path / "run" / "sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, f"unix://{path}", "--log-level", "warn"))
    deadline = time.monotonic() + 20
    while not path.exists():
        assert proc.poll() is None, "sonard exited at start"
        assert time.monotonic() < deadline, "sonard did not bind its socket"
        time.sleep(0.01)
    yield f"unix://{path}", proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert not path.exists(), "socket file left behind by a clean exit"


def hello(conn: Connection) -> None:
    conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": torch.__version__, "threads": 1, "capability": ""})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_private_unix_server_trains_bitwise(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                            zero_copy: bool) -> None:
    monkeypatch.setenv("SONAR_TRANSPORT", "unix")
    torch.manual_seed(11 if zero_copy else 12)
    model = TinyMoE(dtype, experts=5, hidden=13, inter=7)
    ref = TinyMoE(dtype, experts=5, hidden=13, inter=7)
    ref.load_state_dict(model.state_dict())
    hyper: dict[str, Any] = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05}
    g = torch.Generator().manual_seed(5)
    with sonar_moe.SonarAdamW(model, zero_copy=zero_copy, **hyper) as opt:
        assert (opt.server_address or "").startswith("unix:///")
        topt = torch.optim.AdamW(ref.parameters(), **hyper)
        train_beside(model, ref, opt, topt, lambda: torch.randn(6, 13, generator=g).to(dtype), steps=4)
        assert opt.request_traces, "no request traces over unix://"
        assert opt.request_traces[-1].segments()["total"] > 0
    assert_same_params(model, ref)


def test_shared_unix_server_serves_clients_and_survives_bad_input(
        unix_server: tuple[str, subprocess.Popen[bytes]]) -> None:
    addr, proc = unix_server
    path = addr.removeprefix("unix://")
    assert Path(path).stat().st_mode & 0o777 == 0o600
    torch.manual_seed(3)
    models = [TinyMoE(torch.float32) for _ in range(2)]
    refs = [TinyMoE(torch.float32) for _ in range(2)]
    for m, r in zip(models, refs):
        r.load_state_dict(m.state_dict())
    opts = [sonar_moe.SonarAdamW(m, lr=1e-2, server=addr) for m in models]
    topts = [torch.optim.AdamW(r.parameters(), lr=1e-2) for r in refs]
    g = torch.Generator().manual_seed(9)
    try:
        for step in range(3):
            for m, r, o, t in zip(models, refs, opts, topts):
                train_beside(m, r, o, t, lambda: torch.randn(4, 9, generator=g), steps=1)
            # Raw bad input between steps: garbage, a frame longer than any message, a
            # truncated frame, a connection that never says who it is.
            bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bad.connect(path)
            bad.sendall(struct.pack("<I", 3) + b"bad" + struct.pack("<I", 5) + b"\xc1\xff\x00\x01\x02")
            bad.sendall(struct.pack("<I", 0xFFFFFFF0))
            bad.close()
            cut = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            cut.connect(path)
            cut.sendall(struct.pack("<I", 1000) + b"short")
            cut.close()
            mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            mute.connect(path)
            mute.close()
        raw = Connection(addr, timeout=10)
        raw.send_raw([b"\xc1\xff\x00garbage"])
        assert raw.recv_raw(timeout=10)["ok"] is False
        raw.send_raw([b"\x93\x01\x02", b"\x03"])  # one message of two parts: not a request
        rep = raw.recv_raw(timeout=10)
        assert rep["ok"] is False and "protocol" in rep["error"]
        raw.close()
        assert proc.poll() is None
        assert server_stats(addr)["tensors"] == 8  # two clients, four expert tensors each
    finally:
        for o in opts:
            o.close()
    for m, r in zip(models, refs):
        assert_same_params(m, r)


def test_killed_unix_server_is_an_error_within_a_second(unix_server: tuple[str, subprocess.Popen[bytes]]) -> None:
    addr, proc = unix_server
    conn = Connection(addr, timeout=30)
    hello(conn)
    stop(proc.pid)  # the request below waits
    rid = conn.send("stats", {})
    time.sleep(0.2)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(SonarServerDied, match="connection to sonard closed"):
        conn.wait(rid)
    assert time.monotonic() - t0 < 1.0
    conn.close()


def test_stopped_unix_server_is_given_up_like_a_heartbeat_timeout(
        unix_server: tuple[str, subprocess.Popen[bytes]]) -> None:
    addr, proc = unix_server
    conn = Connection(addr, timeout=30)
    hello(conn)
    stop(proc.pid)
    t0 = time.monotonic()
    with pytest.raises(SonarServerDied, match="stopped"):
        conn.call("stats", {})
    took = time.monotonic() - t0
    assert 4.5 < took < 7.0, f"a stopped server was given up after {took:.2f} s (limit 5 s)"
    conn.close()
    os.kill(proc.pid, signal.SIGCONT)


def test_no_unix_server_is_a_clear_error(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(SonarError, match="no sonard listening"):
        Connection(f"unix://{tmp_path}/none.sock", timeout=0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_path_that_cannot_be_a_socket_is_a_clear_error(tmp_path: Path) -> None:
    plain = tmp_path / "a-file"
    plain.write_text("x")
    t0 = time.monotonic()
    with pytest.raises(SonarError, match="connecting to sonard at unix://.*Not a directory"):
        Connection(f"unix://{plain}/sonard.sock", timeout=10)
    assert time.monotonic() - t0 < 1.0  # not retried until the timeout
    with pytest.raises(SonarError, match="no sonard listening"):
        Connection(f"unix://{plain}", timeout=0.2)  # a file, not a socket: refused, retried


def test_private_unix_server_crash_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_TRANSPORT", "unix")
    conn = start_private_server(timeout=10)
    assert conn.address.startswith("unix:///") and conn.process is not None
    hello(conn)
    conn.process.kill()
    with pytest.raises(SonarServerDied, match="killed by SIGKILL"):
        conn.call("stats", {})
    conn.close()


def test_unknown_transport_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_TRANSPORT", "carrier-pigeon")
    with pytest.raises(SonarError, match="SONAR_TRANSPORT"):
        start_private_server(timeout=10)


@pytest.mark.parametrize("setting, seconds", [
    (None, 50e-6), ("", 50e-6), ("50us", 50e-6), ("50\u00b5s", 50e-6), ("0", 0.0), ("0s", 0.0),
    ("1.5ms", 1.5e-3), (".5us", 0.5e-6), ("1m30s", 90.0), ("+20us", 20e-6), ("-5us", 0.0),
])
def test_spin_setting_read_as_sonard_reads_it(sonard_binary: str, setting: str | None, seconds: float) -> None:
    """SONAR_SPIN governs both ends of a unix:// connection: the client reads it as sonard's
    --spin flag does (sonard accepts every value the client does; a negative one never polls)."""
    assert poll_seconds(setting) == pytest.approx(seconds, rel=1e-12, abs=1e-15)
    if setting:
        done = subprocess.run([sonard_binary, "--spin", setting, "--version"], capture_output=True)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("setting", ["50", "us", "50 us", "fast", "-", "5x", "1e3us"])
def test_bad_spin_setting_is_a_clear_error(sonard_binary: str, monkeypatch: pytest.MonkeyPatch,
                                           setting: str) -> None:
    """A SONAR_SPIN that is no duration fails the connection with its name, as sonard's flag
    refuses it, instead of a silent default."""
    done = subprocess.run([sonard_binary, "--spin", setting, "--version"], capture_output=True)
    assert done.returncode != 0
    monkeypatch.setenv("SONAR_SPIN", setting)
    monkeypatch.setenv("SONAR_TRANSPORT", "unix")
    with pytest.raises(ValueError, match="SONAR_SPIN"):
        start_private_server(timeout=10.0)


class SlowPeer:
    """The server's end of one unix:// connection, played by the test so that it can answer
    after a chosen delay (a real socket; the client is sonar_moe's own channel)."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()
        (n,) = struct.unpack("<I", self.conn.recv(4, socket.MSG_WAITALL))
        self.conn.recv(n, socket.MSG_WAITALL)  # the client's id

    def answer_after(self, delay: float, payload: bytes) -> threading.Thread:
        assert self.conn is not None
        conn = self.conn

        def run() -> None:
            time.sleep(delay)
            conn.sendall(struct.pack("<I", len(payload)) + payload)
        th = threading.Thread(target=run)
        th.start()
        return th

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def timed_wait(chan: UnixChannel, peer: SlowPeer, delay: float) -> tuple[float, float, int]:
    """Wall and CPU seconds of this process for one wait on chan for a reply sent after delay,
    and the reads of the wait's poll that found nothing."""
    th = peer.answer_after(delay, b"reply")
    e0, c0, t0 = chan.empty_polls, time.process_time(), time.perf_counter()
    assert chan.recv(10.0) == b"reply"
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    th.join()
    assert wall >= delay * 0.9
    return wall, cpu, chan.empty_polls - e0


def test_client_waits_poll_only_while_replies_are_quick(tmp_path: Path) -> None:
    """A wait for a reply polls (reads the socket again and again) while each wait ended within
    the poll time, and sleeps (no such reads, no CPU) once one took longer, until a wait is quick
    again: a trainer waiting for updates spends no CPU polling. Polls are counted in reads, not
    CPU: on a loaded machine a thread that yields between reads may get little CPU."""
    peer = SlowPeer(tmp_path / "peer.sock")
    accepted = threading.Thread(target=peer.accept)
    accepted.start()
    chan = UnixChannel(str(tmp_path / "peer.sock"), 10.0, lambda: None, PollRule(0.5))
    accepted.join()
    try:
        wall, cpu, polls = timed_wait(chan, peer, 0.15)  # hot: polls throughout the 150 ms
        assert polls >= 10, f"a hot wait read an empty socket {polls} times over {wall:.3f} s: it did not poll"
        wall, cpu, polls = timed_wait(chan, peer, 0.7)  # longer than the poll time: polls 0.5 s, then sleeps
        assert polls >= 10 and cpu < wall * 0.9
        wall, cpu, polls = timed_wait(chan, peer, 0.15)  # cold: sleeps
        assert polls == 0, f"a cold wait read an empty socket {polls} times: it polled"
        assert cpu < wall / 3, f"a cold wait used {cpu:.3f} s of CPU over {wall:.3f} s: it polled"
        timed_wait(chan, peer, 0.0)  # quick again: hot for the next one
        wall, cpu, polls = timed_wait(chan, peer, 0.15)
        assert polls >= 10, "polling did not resume after a quick wait"
    finally:
        chan.close()
        peer.close()


def test_unix_pings_poll_with_the_default_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a real private sonard, with SONAR_SPIN unset, off and longer: every call is
    answered (the polling paths read frames as the sleeping one does)."""
    monkeypatch.setenv("SONAR_TRANSPORT", "unix")
    for setting in ("", "0", "200us"):
        monkeypatch.setenv("SONAR_SPIN", setting)
        conn = start_private_server(timeout=10.0)
        try:
            for i in range(300):
                assert conn.call("ping", {"i": i}) is not None
        finally:
            conn.shutdown()


def test_a_process_on_one_cpu_does_not_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Confined to one CPU (taskset), the client does not poll for replies: the server it waits
    for needs that very CPU. Checked in a child process confined with sched_setaffinity."""
    monkeypatch.setenv("SONAR_SPIN", "50us")
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, sys; from sonar_moe._channel import reply_poll_seconds; "
            "os.sched_setaffinity(0, {int(sys.argv[1])}); print(reply_poll_seconds())")
    out = subprocess.run([sys.executable, "-c", code, str(cpus[0])], capture_output=True, text=True, check=True)
    assert float(out.stdout) == 0.0
    assert reply_poll_seconds() == pytest.approx(50e-6 if len(cpus) > 1 else 0.0)
