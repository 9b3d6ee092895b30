"""Finding the sonard binary."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._connection import SonarError


def find_sonard() -> str:
    """The server binary: $SONARD, then the repository's bin/sonard, then the one installed
    with the wheel (sonar_moe/bin/sonard), then PATH."""
    env = os.environ.get("SONARD")
    if env:
        if not os.access(env, os.X_OK):
            raise SonarError(f"$SONARD={env!r} is not an executable file")
        return env
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "bin" / "sonard", here / "bin" / "sonard"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("sonard")
    if found:
        return found
    raise SonarError("sonard not found: set $SONARD, run `make build` (bin/sonard), or put sonard on PATH")
