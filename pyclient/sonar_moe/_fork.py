"""Fork safety: what a forked child inherits of this process's sonar objects.

After ``fork`` a child shares the parent's memory mappings that are ``MAP_SHARED`` (the
expert parameters, the gradient ring) and holds copies of the parent's connection to sonard,
its private server's ``Popen`` object and its run directory. Left alone, an in-place write
in the child would change the parent's model, and the child's exit would shut the parent's
private server down and delete its run directory.

So, in every child (``os.register_at_fork``):

* each shared segment is re-mapped at the same address as a private copy-on-write mapping
  of the same memory (``MAP_PRIVATE | MAP_FIXED``): the child reads the parameters, and its
  writes get their own copy, as with any memory after ``fork``; nothing is copied up front;
* each connection becomes inert: it sends nothing, its requests in flight are forgotten,
  and closing it (``close()``, a finalizer, interpreter exit) does not tell the server
  anything, stop the parent's private sonard or remove its run directory. Using the
  optimizer in the child (a backward pass over hooked expert tensors, ``step()``) raises
  :class:`~._connection.SonarError`: build a new ``SonarAdamW`` in the child.

DataLoader workers (fork start method) never touch the optimizer and keep working.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Protocol

log = logging.getLogger("sonar_moe")


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None:
        ...


_live: weakref.WeakValueDictionary[int, ForkAware] = weakref.WeakValueDictionary()


def track(obj: ForkAware) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked while obj lives."""
    _live[id(obj)] = obj


def _in_child() -> None:
    for obj in list(_live.values()):
        try:
            obj._after_fork_in_child()
        except Exception as e:  # noqa: BLE001 - the child must still start
            log.warning("sonar_moe: after fork: %s", e)


os.register_at_fork(after_in_child=_in_child)
