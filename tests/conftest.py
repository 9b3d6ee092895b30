"""Shared fixtures: the repo's examples on sys.path and a built sonard."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "pyclient"))


@pytest.fixture(scope="session", autouse=True)
def sonard_binary() -> str:
    """Build bin/sonard once per test session with scripts/build-go (incremental) and point
    $SONARD at it, unless $SONARD is set."""
    if "SONARD" not in os.environ:
        subprocess.run([str(ROOT / "scripts" / "build-go"), "sonard"], cwd=ROOT, check=True)
        os.environ["SONARD"] = str(ROOT / "bin" / "sonard")
    return os.environ["SONARD"]


def shm_names() -> set[str]:
    """The shared-memory segments of this process's SonarAdamW that exist now (each name starts
    with its creator's pid: a test running beside this one in another worker makes its own)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"sonar-{os.getpid()}-")}


def sonard_command(binary: str, addr: str, *extra: str) -> list[str]:
    """A plain sonard command line listening on addr: nothing about the clients' torch is a
    server setting (each client names its float32 sqrt in hello), so it serves every client bitwise."""
    return [binary, "--listen", addr, *extra]


@pytest.fixture()
def shared_server(sonard_binary: str, tmp_path: Path) -> Iterator[str]:
    """A sonard started by the test and shared by several clients; its address."""
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    yield addr
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def server_stats(addr: str) -> dict[str, Any]:
    """The counters of the server at addr, over a connection of its own."""
    from sonar_moe import Connection

    conn = Connection(addr, timeout=10)
    try:
        return conn.call("stats", {})
    finally:
        conn.close()
