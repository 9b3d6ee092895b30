"""Shared fixtures: the repo's examples on sys.path and a built sonard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "pyclient"))


@pytest.fixture(scope="session", autouse=True)
def sonard_binary() -> str:
    """Build bin/sonard once per test session (go build is incremental) and point $SONARD at it."""
    out = ROOT / "bin" / "sonard"
    if "SONARD" not in os.environ:
        subprocess.run(["go", "build", "-o", str(out), "./cmd/sonard"], cwd=ROOT, check=True)
        os.environ["SONARD"] = str(out)
    return os.environ["SONARD"]


def shm_names() -> set[str]:
    """The sonar-* shared-memory segments that exist now."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("sonar-")}
