"""Lifetimes (issue 16, item 3): a private sonard ends with its trainer however the trainer
ends; a session lives as long as its connection, never by the pid a client reports; a shared
server's death is noticed by its clients within a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import server_stats, sonard_command
from lifetime_util import ROOT, TRAINER, ready_pid, running, stop, trainer, wait_gone

from sonar_moe import Connection, SonarServerDied, start_private_server


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "exit"])
def test_private_server_exits_within_a_second_of_its_trainer(how: str) -> None:
    p = trainer(how)
    server = ready_pid(p)
    assert running(server)
    args = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    rundir = Path(args[args.index(b"--run-dir") + 1].decode())
    assert rundir.is_dir()
    p.wait(timeout=30)
    took = wait_gone(server, 5.0)
    assert took < 1.0, f"sonard outlived its trainer ({how}) by {took:.2f} s"
    assert not rundir.exists(), "the private server's run directory was left behind"


def test_private_server_removes_its_run_directory_when_its_owner_stops_it() -> None:
    """A client interrupted between its shutdown request and removing the run directory
    (Ctrl-C while close() waited for sonard) left the directory, its log and its owner token
    behind in the temporary directory, once for every such run: sonard, told to stop by its
    owner's token, removes it as it does when its owner has exited."""
    conn = start_private_server(timeout=10.0)
    assert conn.process is not None and conn.log_path is not None and conn.admin_token is not None
    rundir = Path(conn.log_path).parent
    try:
        conn.call("ping", {})
        assert rundir.is_dir() and {p.name for p in rundir.iterdir()} >= {"sonard.log", "owner.token"}
        conn.call("shutdown", {"token": conn.admin_token})  # what shutdown() sends, without its rmtree
        assert conn.process.wait(timeout=10) == 0
        assert not rundir.exists(), f"left behind: {sorted(p.name for p in rundir.iterdir())}"
    finally:
        conn.close()
        if conn.process.poll() is None:
            conn.process.kill()


def test_private_server_survives_the_thread_that_started_it() -> None:
    """The parent-death signal is tied to the thread that forked sonard: SonarAdamW built in
    a thread that ended must keep its server (the trainer trains on from its main thread),
    and the server still ends with the process."""
    p = trainer("thread")
    server = ready_pid(p)  # printed after two more steps, 1.5 s after the thread ended
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert wait_gone(server, 5.0) < 1.0


@pytest.fixture()
def grace_server(sonard_binary: str, tmp_path: Path) -> Iterator[str]:
    """A shared sonard with a 1 s reconnect grace."""
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn", "--reconnect-grace", "1s"))
    yield addr
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def wait_sessions(addr: str, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while (got := server_stats(addr)["sessions"]) != n:
        assert time.monotonic() - t0 < timeout, f"{got} sessions, want {n}"
        time.sleep(0.05)
    return time.monotonic() - t0


def hello(conn: Connection, pid: int) -> None:
    conn.call("hello", {"client": "test", "pid": pid, "torch": torch.__version__, "threads": 1, "capability": ""})


def test_session_ignores_the_pid_the_client_reports(grace_server: str) -> None:
    """A client that reports the pid of a process that exited (as a client in another pid
    namespace may) keeps its session while its connection is open."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    conn = Connection(grace_server, timeout=5)
    hello(conn, gone.pid)
    time.sleep(2.5)  # > grace + a tick
    assert server_stats(grace_server)["sessions"] == 1
    conn.call("stats", {})
    conn.close()
    assert wait_sessions(grace_server, 0, 3.0) < 3.0


def test_closed_connection_releases_its_session(grace_server: str) -> None:
    """A live process that closes its socket without bye: released after the grace period."""
    conn = Connection(grace_server, timeout=5)
    hello(conn, os.getpid())  # a live pid: the old server kept such sessions forever
    conn.close()
    took = wait_sessions(grace_server, 0, 5.0)
    print(f"closed connection's session released after {took:.3f} s (grace 1 s)")
    assert 0.5 < took < 3.0, took


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"), reason="needs root and unshare")
def test_client_in_another_pid_namespace(grace_server: str) -> None:
    """A trainer in its own pid namespace (it reports pid 1 or 2): served while it lives,
    released when it is killed."""
    env = {**os.environ, "SONAR_PYCLIENT": str(ROOT / "pyclient")}
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", TRAINER, "wait", grace_server],
                         stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env)
    ready_pid(p)
    time.sleep(2.0)
    st = server_stats(grace_server)
    assert st["sessions"] == 1 and st["tensors"] == 1, st
    p.kill()  # unshare --kill-child: the trainer gets SIGKILL
    p.wait(timeout=10)
    assert wait_sessions(grace_server, 0, 5.0) < 3.0
    st = server_stats(grace_server)
    assert st["tensors"] == 0 and st["segments"] == 0, st


def test_shared_server_death_noticed_within_a_second(sonard_binary: str, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    try:
        conn = Connection(addr, timeout=30)
        hello(conn, os.getpid())
        stop(proc.pid)  # the request below waits: the server hangs
        killed: list[float] = []

        def kill() -> None:
            time.sleep(0.3)
            killed.append(time.monotonic())
            proc.kill()

        threading.Thread(target=kill).start()
        with pytest.raises(SonarServerDied, match="connection to sonard"):
            conn.call("stats", {})
        took = time.monotonic() - killed[0]
        print(f"killed shared server noticed after {took:.3f} s")
        assert took < 1.0, f"noticed {took:.2f} s after the server was killed"
        conn.close()
    finally:
        proc.kill()
        proc.wait()


def test_hung_shared_server_noticed_by_heartbeat(sonard_binary: str, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    try:
        conn = Connection(addr, timeout=30)
        hello(conn, os.getpid())
        stop(proc.pid)
        t0 = time.monotonic()
        with pytest.raises(SonarServerDied):
            conn.call("stats", {})
        took = time.monotonic() - t0
        print(f"stopped shared server noticed after {took:.3f} s")
        assert took < 7.0, f"a stopped server was noticed after {took:.2f} s (heartbeat timeout 5 s)"
        conn.close()
    finally:
        proc.kill()
        proc.wait()
