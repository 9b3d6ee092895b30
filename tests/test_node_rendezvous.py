"""The node server's rendezvous files (pyclient/sonar_moe/_node.py): local rank 0 publishes its
sonard's address in a file named after the launch and removes it at exit; a rank 0 that a
launcher stopped with SIGTERM or SIGKILL never did, and each such launch left one in the
temporary directory. A new local rank 0 removes this user's files whose process is gone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Local rank 0 of two: starts the node's sonard, publishes its address, lists the directory.
LEADER = """
import os
from sonar_moe import _node
conn = _node.node_connection(10.0)
print("\\n".join(sorted(os.listdir(os.path.dirname(_node.rendezvous_path())))), flush=True)
"""


@pytest.fixture()
def tmpdir_short() -> Iterator[Path]:
    """A temporary directory of a short path (the node's sonard puts its socket in it)."""
    d = Path(tempfile.mkdtemp(prefix="sn-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _rendezvous(d: Path, name: str, pid: int) -> Path:
    p = d / f"sonar-node-{name}.json"
    p.write_text(json.dumps({"address": f"ipc://{d}/gone/sonard.sock", "pid": pid}))
    return p


def test_new_leader_removes_rendezvous_files_of_gone_launches(tmpdir_short: Path, sonard_binary: str) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = _rendezvous(tmpdir_short, "a" * 24, gone.pid)        # rank 0 killed: its process is gone
    live = _rendezvous(tmpdir_short, "b" * 24, os.getpid())      # another launch, still running
    torn = tmpdir_short / f"sonar-node-{'c' * 24}.json"           # being written, or damaged
    torn.write_text("{")
    other = tmpdir_short / "sonar-node-notes.txt"                 # not a rendezvous file
    other.write_text(str(gone.pid))
    env = dict(os.environ, TMPDIR=str(tmpdir_short), LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               SONAR_NODE_EXIT_WAIT="0", PYTHONPATH=str(ROOT / "pyclient"))
    r = subprocess.run([sys.executable, "-c", LEADER], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = set(r.stdout.split())
    assert stale.name not in listed and not stale.exists()
    assert {live.name, torn.name, other.name} <= listed and live.exists() and torn.exists() and other.exists()
    mine = listed - {live.name, torn.name, other.name}
    assert any(n.startswith("sonar-node-") and n.endswith(".json") for n in mine), listed  # its own, published
    # and removed at its exit, as before, with its sonard's run directory
    assert not [p for p in tmpdir_short.glob("sonar-node-*.json") if p not in (live, torn)]
    assert not list(tmpdir_short.glob("sonar-*/")), sorted(p.name for p in tmpdir_short.iterdir())
