"""Transports (issue 16, item 4): only ipc:// and tcp:// with CURVE are served; only the owner
of a private sonard, or an admin holding the token, may shut a server down."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import server_stats, sonard_command
from sonar_moe import Connection, SonarError, SonarRefused
from sonar_moe._launch import start_private_server


@pytest.mark.parametrize("addr", ["ws://127.0.0.1:0", "wss://127.0.0.1:0", "inproc://sonard", "ipc://@sonard-abstract",
                                  "tcp://127.0.0.1:0", "udp://127.0.0.1:5555", "pgm://lo;239.192.1.1:5555",
                                  "TCP://127.0.0.1:0", "127.0.0.1:5555"])
def test_server_refuses_transports_off_the_allow_list(sonard_binary: str, addr: str) -> None:
    r = subprocess.run(sonard_command(sonard_binary, addr), capture_output=True, text=True, timeout=30)
    assert r.returncode == 64, r.stderr  # bad flags
    assert "not allowed" in r.stderr, r.stderr


@pytest.mark.parametrize("addr", ["ws://127.0.0.1:5555", "inproc://sonard", "ipc://@x", "wss://h:1"])
def test_client_refuses_transports_off_the_allow_list(addr: str) -> None:
    with pytest.raises(SonarError, match="only ipc:///path, unix:///path and tcp://"):
        Connection(addr, timeout=1)


def hello(conn: Connection) -> None:
    conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": torch.__version__, "threads": 1, "capability": ""})


def test_only_the_owner_stops_a_private_server() -> None:
    owner = start_private_server(timeout=10)
    assert owner.process is not None
    try:
        hello(owner)
        other = Connection(owner.address, timeout=10)
        for body in ({}, {"token": ""}, {"token": "0" * 64}):
            with pytest.raises(SonarRefused, match="not allowed"):
                other.call("shutdown", body)
        other.close()
        assert owner.process.poll() is None
        assert owner.call("stats", {})["requests"] > 0  # still serving
    finally:
        owner.shutdown()  # the owner's token
    assert owner.process.wait(timeout=10) == 0


def test_shared_server_shutdown_needs_the_admin_token(sonard_binary: str, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    token = tmp_path / "admin.token"
    token.write_text("an-admin-secret-of-enough-length\n")
    token.chmod(0o600)
    plain = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    try:
        conn = Connection(addr, timeout=10)
        with pytest.raises(SonarRefused, match="no owner or admin token"):
            conn.call("shutdown", {"token": "anything"})
        conn.close()
        assert server_stats(addr)["by_op"]["shutdown"] == 1
    finally:
        plain.terminate()
        assert plain.wait(timeout=10) == 0
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn", "--admin-token-file", str(token)))
    conn = Connection(addr, timeout=10)
    with pytest.raises(SonarRefused, match="not allowed"):
        conn.call("shutdown", {"token": "an-admin-secret-of-enough-lengtx"})
    assert conn.call("shutdown", {"token": "an-admin-secret-of-enough-length"}) == {"shutdown": True}
    conn.close()
    assert proc.wait(timeout=10) == 0
    token.chmod(0o644)  # a token file others can read is refused
    r = subprocess.run(sonard_command(sonard_binary, addr, "--admin-token-file", str(token)), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 64 and "want 0600" in r.stderr, r.stderr
