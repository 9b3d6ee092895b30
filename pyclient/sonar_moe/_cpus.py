"""How many CPUs this process may run on: the sizing of a private sonard's workers
(``_launch``), whether torch's threads leave a core free (``_shm_backend``), and whether a
unix:// wait for a reply polls (``_channel``)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
