"""Ctrl-C held while SonarAdamW hands an update over.

A KeyboardInterrupt is raised between any two bytecodes of the main thread. Inside the code
that counts a step, queues its gradient, sends the request and matches the reply, most such
places leave the client and sonard disagreeing for good: a request recorded as pending but
never sent, a reply received but never handled (waited for until the timeout at every later
step), a step counted but its items dropped ("client step 4 but server is at step 2" ever
after). So SonarAdamW's hooks and ``step()`` run with SIGINT's Python handler held: a Ctrl-C
that comes meanwhile is delivered, to the handler that was installed, as soon as they return
(a wait on sonard lasts at most the optimizer's timeout). Only the main thread receives
Python signal handlers, so other threads (autograd's device threads) need nothing.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

# signal.signal of the C module that ``signal`` wraps (CPython's ``_signal``): it takes and
# returns plain numbers and callables. ``signal.signal`` converts both to enums on every call,
# which took 10 of the 11 us that holding and giving back SIGINT cost (a hold runs in every
# gradient hook: bench/hooks.py).
_set_handler: Callable[[int, Any], Any] = importlib.import_module("_signal").signal


class HeldInterrupt:
    """A reentrant context that defers SIGINT's Python handler until the outermost exit."""

    def __init__(self) -> None:
        self._depth = 0
        self._installed: Any = None  # the handler replaced (a Python callable), while held
        self._caught: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> HeldInterrupt:
        # get_ident() against the main thread's: threading.current_thread() is a lookup of its own
        if self._depth == 0 and threading.get_ident() == threading.main_thread().ident:
            try:
                old = _set_handler(signal.SIGINT, self._hold)
            except (ValueError, OSError):  # not the main interpreter: nothing to hold
                old = None
            if callable(old):
                self._installed = old
            elif old is not None:  # SIG_IGN/SIG_DFL: no Python exception can come; leave it as it was
                _set_handler(signal.SIGINT, old)
        self._depth += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._depth -= 1
        if self._depth or self._installed is None:
            return
        handler, self._installed = self._installed, None
        _set_handler(signal.SIGINT, handler)
        caught, self._caught = self._caught, None
        if caught is not None:
            handler(*caught)  # Python's default raises KeyboardInterrupt here

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self._caught = (signum, frame)


# One for the process: signal handlers are process-wide.
HELD = HeldInterrupt()
