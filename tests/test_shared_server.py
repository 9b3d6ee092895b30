"""One shared sonard serving several trainer processes: no cross-talk, and the state of a
client killed mid-step is released."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from conftest import server_stats

WORKER = str(Path(__file__).with_name("worker.py"))




def test_four_trainers_share_one_server_without_cross_talk(shared_server: str) -> None:
    procs = [subprocess.Popen([sys.executable, WORKER, shared_server, str(seed), "40"],
                              stdout=subprocess.PIPE, text=True) for seed in range(4)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for seed, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK seed {seed}" in out, out
    st = server_stats(shared_server)
    assert st["errors"] == 0
    assert st["step_items"] == 4 * 40 * 2 * 2  # clients x steps x layers x expert tensors
    assert st["tensors"] == 0 and st["segments"] == 0  # every client said goodbye


def test_killed_client_is_released(shared_server: str) -> None:
    p = subprocess.Popen([sys.executable, WORKER, shared_server, "9", "5", "--die-after-backward"],
                         stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=120)
    assert "READY" in out and p.returncode != 0
    deadline = time.monotonic() + 10
    while True:
        st = server_stats(shared_server)
        if st["tensors"] == 0 and st["segments"] == 0:
            break
        assert time.monotonic() < deadline, f"server still holds the dead client's memory: {st}"
        time.sleep(0.2)
    # and it keeps serving others
    ok = subprocess.run([sys.executable, WORKER, shared_server, "3", "3"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
