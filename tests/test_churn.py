"""No leaks (issue 16, item 7): clients that come and go leave nothing in the server (its
sessions, tensors, segments, metric series, file descriptors) and its memory stays flat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import sonard_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import churn  # noqa: E402


def test_clients_that_come_and_go_leave_nothing(sonard_binary: str, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    metrics = f"127.0.0.1:{churn.free_port()}"
    # GOGC=10: the heap is collected often, so RSS follows live memory, not the collector's pace.
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "error", "--reconnect-grace", "100ms",
                                           "--metrics-addr", metrics), env={**os.environ, "GOGC": "10"})
    try:
        time.sleep(0.5)
        warm = churn.churn(addr, proc.pid, 200, f"http://{metrics}/metrics", samples=2)[-1]
        rows = churn.churn(addr, proc.pid, 1200, f"http://{metrics}/metrics", samples=4)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    end = rows[-1]
    assert end["sessions"] == 0 and end["tensors"] == 0 and end["segments"] == 0, end
    assert end["series"] == 0, end
    assert end["fds"] <= warm["fds"], (warm, end)
    print(warm, rows)
    # 1,200 more clients after the first 200: memory flat within 8 MiB (a session with its
    # segment mapping, tensor state and metric series is ~10 KiB: 1,200 leaked ones ~12 MiB).
    assert end["rss_mib"] - warm["rss_mib"] < 8.0, (warm, rows)
