"""tcp:// needs CURVE: a client with an allowed key trains bit for bit; others get nothing.

A tcp:// server never loads a client's library, so a client whose torch computes float32 sqrt
with MKL trains bfloat16 here (IEEE sqrt everywhere); with float32 it is refused with a clear
error instead of drifting from torch in the last bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sonar_moe import SonarError
from conftest import sonard_command
from sonar_moe import Connection
from sonar_moe import torch_sqrt_library

WORKER = str(Path(__file__).with_name("worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def curve_server(sonard_binary: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    for who in ("server", "client", "stranger"):
        subprocess.run([sonard_binary, "--gen-curve-keys", str(tmp_path / who)], check=True)
    assert (tmp_path / "server.secret").stat().st_mode & 0o777 == 0o600
    (tmp_path / "allowed").write_text((tmp_path / "client.public").read_text())
    addr = f"tcp://127.0.0.1:{free_port()}"
    # The operator trusts this torch's sqrt library: float32 clients are served bitwise over tcp.
    trusted = ["--trusted-sqrt-lib", torch_sqrt_library() or ""]
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--curve-secret-file", str(tmp_path / "server.secret"),
                                           "--curve-clients-file", str(tmp_path / "allowed"), "--log-level", "warn",
                                           *trusted))
    yield addr, tmp_path
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def test_tcp_without_keys_is_refused(sonard_binary: str) -> None:
    r = subprocess.run([sonard_binary, "--listen", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True)
    assert r.returncode == 64 and "curve" in r.stderr.lower()


def test_allowed_client_trains_and_stranger_is_ignored(curve_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    addr, keys = curve_server
    env = dict(os.environ, SONAR_CURVE_SERVER_PUBLIC_FILE=str(keys / "server.public"),
               SONAR_CURVE_CLIENT_KEYS=str(keys / "client"))
    r = subprocess.run([sys.executable, WORKER, addr, "4", "3", "--bf16"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK seed 4" in r.stdout, r.stdout + r.stderr
    # float32: bitwise, with this torch's sqrt library trusted by the server.
    r = subprocess.run([sys.executable, WORKER, addr, "5", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK seed 5" in r.stdout, r.stdout + r.stderr
    # A client whose key is not allowed: the handshake fails, no request is ever served.
    monkeypatch.setenv("SONAR_CURVE_SERVER_PUBLIC_FILE", str(keys / "server.public"))
    monkeypatch.setenv("SONAR_CURVE_CLIENT_KEYS", str(keys / "stranger"))
    conn = Connection(addr, timeout=2.0)
    with pytest.raises(SonarError, match="did not answer"):
        conn.call("stats", {})
    conn.close()
    # Without keys the client refuses to connect in the clear.
    monkeypatch.delenv("SONAR_CURVE_CLIENT_KEYS")
    with pytest.raises(SonarError, match="CURVE"):
        Connection(addr, timeout=2.0)


def test_untrusted_library_over_tcp_is_refused(sonard_binary: str, tmp_path: Path) -> None:
    """A tcp:// sonard loads no library its operator did not name; the client says how to fix it."""
    if torch_sqrt_library() is None:
        pytest.skip("this torch's float32 sqrt is IEEE: no library to name")
    for who in ("server", "client"):
        subprocess.run([sonard_binary, "--gen-curve-keys", str(tmp_path / who)], check=True)
    (tmp_path / "allowed").write_text((tmp_path / "client.public").read_text())
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--curve-secret-file", str(tmp_path / "server.secret"),
                                           "--curve-clients-file", str(tmp_path / "allowed"), "--log-level", "warn"))
    try:
        env = dict(os.environ, SONAR_CURVE_SERVER_PUBLIC_FILE=str(tmp_path / "server.public"),
                   SONAR_CURVE_CLIENT_KEYS=str(tmp_path / "client"))
        r = subprocess.run([sys.executable, WORKER, addr, "5", "2"], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "--trusted-sqrt-lib" in r.stderr and "bfloat16" in r.stderr, r.stdout + r.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
