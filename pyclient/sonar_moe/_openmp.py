"""torch's OpenMP threads while a gradient hook waits for sonard.

With ``ring_layers=0`` the hook that sends a layer's request waits for it. libgomp (the OpenMP runtime of
torch's Linux wheels) lets a thread that ran out of work spin for several milliseconds before it
sleeps, so while the hook waits torch's other threads spin on the cores sonard's update needs.
``GOMP_SPINCOUNT`` (read when libgomp is loaded, so set before Python starts) shortens that; see
docs/benchmarks.md, "torch's OpenMP threads: spinning or sleeping".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("sonar_moe")

SUGGESTED_SPINCOUNT = 10000


def default_spin_runtime(environ: Mapping[str, str] = os.environ, maps_path: str = "/proc/self/maps") -> str | None:
    """The file of the libgomp loaded in this process when its spin-wait is left at the default
    (neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` set), else None (another runtime, or
    none, or one already told how long to spin)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return None
    try:
        with open(maps_path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and "libgomp" in os.path.basename(fields[-1]):
                    return fields[-1]
    except OSError:
        return None
    return None


class SpinAdvice:
    """Says once (INFO) how to stop torch's idle threads spinning while hooks wait."""

    def __init__(self) -> None:
        self.told = False

    def advise(self, ring_layers: int, threads: int, environ: Mapping[str, str] = os.environ,
               maps_path: str = "/proc/self/maps") -> bool:
        """Log the advice if hooks wait (``ring_layers`` 0), torch runs several threads and
        libgomp spins at its default; True when it did (never twice)."""
        if self.told or ring_layers != 0 or threads < 2:
            return False
        runtime = default_spin_runtime(environ, maps_path)
        if runtime is None:
            return False
        self.told = True
        log.info("ring_layers=0: each gradient hook waits for sonard, and meanwhile torch's other %d OpenMP "
                 "thread(s) (%s) spin for milliseconds on the cores the update needs. Starting the trainer "
                 "with GOMP_SPINCOUNT=%d in its environment lets them sleep: 4-11%% faster steps in "
                 "docs/benchmarks.md", threads - 1, os.path.basename(runtime), SUGGESTED_SPINCOUNT)
        return True


ADVICE = SpinAdvice()  # one per process: SonarAdamW asks it each time it is built
