"""The sonard process: flags, graceful shutdown, shared memory left behind, a dead server."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import sonar_moe
import tiny_moe as tm
from conftest import shm_names


def test_version_flag(sonard_binary: str) -> None:
    out = subprocess.run([sonard_binary, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("sonard ") and "protocol 1" in out


def test_bad_flag_exits_2(sonard_binary: str) -> None:
    assert subprocess.run([sonard_binary, "--no-such-flag"], capture_output=True).returncode == 2
    assert subprocess.run([sonard_binary, "--log-format", "xml"], capture_output=True).returncode == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_gracefully(sonard_binary: str, tmp_path: Path, sig: signal.Signals) -> None:
    sock = tmp_path / "run" / "s.sock"
    proc = subprocess.Popen([sonard_binary, "--listen", f"ipc://{sock}", "--log-format", "json"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert time.monotonic() < deadline, "sonard did not bind"
        time.sleep(0.02)
    assert (sock.stat().st_mode & 0o777) == 0o600
    assert (sock.parent.stat().st_mode & 0o777) == 0o700
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == 0
    assert not sock.exists()
    assert '"sonard stopped"' in proc.stderr.read()


def test_no_shared_memory_left_behind() -> None:
    before = shm_names()
    model = tm.build(tm.MoEConfig(), 0)
    with sonar_moe.SonarAdamW(model) as opt:
        x = torch.randint(0, 256, (2, 16))
        loss, _ = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.state_dict()
        # The server unlinks each segment once it has mapped it.
        assert shm_names() - before == set()
    assert shm_names() - before == set()
    # The parameters stay usable after close.
    assert torch.isfinite(next(model.parameters())).all()


def test_dead_server_raises_quickly_instead_of_hanging() -> None:
    model = tm.build(tm.MoEConfig(), 0)
    opt = sonar_moe.SonarAdamW(model, timeout=5.0)
    try:
        proc = opt._conn.process
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        start = time.monotonic()
        with pytest.raises(sonar_moe.SonarError, match="exited|did not answer"):
            x = torch.randint(0, 256, (2, 16))
            loss, _ = model(x, labels=x)
            loss.backward()
            opt.step()
        assert time.monotonic() - start < 10
    finally:
        opt._closed = True  # the server is gone; nothing to say goodbye to
        opt._finalizer.detach()
        opt._conn.close()
