"""Ending a session quietly: no "sonard did not acknowledge the goodbye" warning when the private
server did exit cleanly (normal close(), many times over; the server interrupted by SIGINT;
a reply that arrived while the client was still checking whether the server lives)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sonar_moe
from lifetime_util import stop
from sonar_moe import Connection, SonarServerDied, start_private_server

ROOT = Path(__file__).resolve().parents[1]


class ReaderThatLosesTheRace(Connection):
    """A connection whose first read finds nothing because the server's reply arrives, and the
    server exits, just after the read: the order of events behind the spurious warning."""

    def poll(self, timeout: float = 0.0) -> int:
        if self.process is not None and self.process.poll() is None:
            self.process.wait(timeout=10)
            return 0
        return super().poll(timeout)


def racing_connection() -> ReaderThatLosesTheRace:
    plain = start_private_server(10.0)
    plain.close()  # its socket only: the server goes on, a new connection takes over
    return ReaderThatLosesTheRace(address=plain.address, timeout=10.0, process=plain.process,
                                  log_path=plain.log_path, admin_token=plain.admin_token)


@pytest.mark.parametrize("how", ["wait", "wait_any"])
def test_a_reply_sent_before_the_server_exited_is_read(how: str) -> None:
    conn = racing_connection()
    try:
        rid = conn.send("shutdown", {"token": conn.admin_token})
        if how == "wait":
            rep = conn.wait(rid)
            assert rep["ok"] and rep["body"]["shutdown"]
        else:
            conn.wait_any()
            assert conn.in_flight == 0
        assert conn.process is not None and conn.process.returncode == 0
    finally:
        conn.close()


def test_a_server_that_dies_without_answering_is_still_detected() -> None:
    conn = start_private_server(10.0)
    try:
        assert conn.process is not None
        # Stopped, every thread of it, before the request, so it cannot answer first (over unix://
        # it otherwise could, within microseconds of the send: seen in CI's unix run).
        stop(conn.process.pid)
        conn.send("stats", {})
        conn.process.kill()
        conn.process.wait()
        with pytest.raises(SonarServerDied, match="killed by SIGKILL"):
            conn.wait()
    finally:
        conn.close()


def test_shutdown_of_a_server_ending_on_sigint_is_quiet() -> None:
    """SIGINT (a Ctrl-C that reaches the server too) makes sonard stop serving and exit 0; a
    goodbye sent meanwhile gets no reply, and that is no failure. The delays sweep the window
    between the signal and the server's exit."""
    for delay in (0.0, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.15):
        conn = start_private_server(10.0)
        conn.call("stats", {})
        assert conn.process is not None
        conn.process.send_signal(signal.SIGINT)
        time.sleep(delay)
        conn.shutdown()  # raised SonarServerDied("sonard exited with code 0") before the fix
        assert conn.process.returncode == 0


def test_a_sigint_that_lands_while_the_server_is_stopping_is_quiet() -> None:
    """A SIGINT that reaches sonard once a client's shutdown has begun to stop it (a signal to a
    whole process group, a service manager's stop, a test's signal sent just before its goodbye)
    must still leave exit code 0: sonard died of it (code -2) when it gave up its signal
    handling as it began to stop, seen in CI. The signal is sent again and again from the
    shutdown reply until the exit, so some copy lands in every stage of the stopping."""
    for _ in range(5):
        conn = start_private_server(10.0)
        assert conn.process is not None
        rep = conn.call("shutdown", {"token": conn.admin_token or ""})
        assert rep["shutdown"]
        sent = 0
        while conn.process.poll() is None:
            conn.process.send_signal(signal.SIGINT)
            sent += 1
            time.sleep(0.0002)
        assert conn.process.returncode == 0, f"sonard exited {conn.process.returncode} after {sent} SIGINTs"
        conn.shutdown()


def test_many_open_close_cycles_log_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    w = torch.nn.Parameter(torch.randn(4, 8, 16))
    with caplog.at_level(logging.WARNING, logger="sonar_moe"):
        for _ in range(25):
            opt = sonar_moe.SonarAdamW([("layer.experts.w", w)], lr=1e-2)
            w.square().sum().backward()
            opt.step()
            opt.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


CHILD = """
import signal, sys, torch, sonar_moe
# A job started in the background of a non-interactive shell inherits SIGINT ignored; a trainer
# in a terminal has Python's handler, which is what this test is about.
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 64, 64))
d = torch.nn.Parameter(torch.randn(64, 64))
opt = sonar_moe.SonarAdamW([("m.experts.w", w), ("m.dense", d)])
x = torch.randn(32, 64)
print("ready", opt.server_process.pid, flush=True)
while True:
    torch.einsum("bi,eij->bej", x @ d, w).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("server_too", [False, True], ids=["trainer", "trainer_and_server"])
def test_ctrl_c_in_training_is_quiet(server_too: bool) -> None:
    """SIGINT to a training process (and to its sonard, as when the signal goes to every
    process): a KeyboardInterrupt traceback, no goodbye warning, the server gone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "pyclient")}
    for pause in (0.1, 0.4):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env)
        assert proc.stdout is not None
        word, pid = proc.stdout.readline().split()
        assert word == b"ready"
        time.sleep(pause)
        if server_too:
            os.kill(int(pid), signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        text = err.decode()
        assert "KeyboardInterrupt" in text
        assert "acknowledge" not in text and "Exception ignored" not in text, text
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)  # the server is gone (exited and reaped by its parent)
