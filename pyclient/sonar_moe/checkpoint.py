"""Checkpoint files that are written atomically and checked on load.

``save_checkpoint(path, obj)`` serializes ``obj`` with ``torch.save`` (for example
``{"model": model.state_dict(), "opt": opt.state_dict()}``), writes it to a temporary file
in the same directory with a SHA-256 of the payload, fsyncs, renames it over ``path`` and
fsyncs the directory: a crash leaves either the old or the new checkpoint, never a torn
one. ``load_checkpoint(path)`` verifies the checksum before unpickling anything.

The temporary file (``.<name>.sonar-tmp-<pid>-<random>``) is removed when the save fails or
is interrupted (an exception, Ctrl-C, or SIGTERM while the process has no handler of its own:
the signal is delivered again once the file is gone). A process killed outright (SIGKILL,
power loss) cannot clean up: the next save of the same checkpoint removes temporaries whose
process no longer exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import signal
import struct
import threading
from collections.abc import Iterator
from typing import Any

import torch

MAGIC = b"SONARCK1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted, or not a Sonar checkpoint."""


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.sonar-tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files of earlier saves of ``path`` whose process no longer exists
    (a save killed outright); return their names."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _tmp_prefix(path)
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(prefix):
            continue
        pid_s = name[len(prefix):].split("-", 1)[0]
        if not pid_s.isdigit() or int(pid_s) == os.getpid() or _pid_alive(int(pid_s)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


class _Terminated(BaseException):
    """SIGTERM arrived while a checkpoint was being written."""


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into an exception while the body runs, so that its cleanup runs; the
    signal is then delivered again with the default action. Only where the process left
    SIGTERM at its default (a handler of the program's own stays in charge) and only on the
    main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die as the signal asked, the temporary file removed
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def save_checkpoint(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` (anything ``torch.save`` takes) to ``path``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    tmp = os.path.join(directory, f"{_tmp_prefix(path)}{os.getpid()}-{secrets.token_hex(4)}")
    with _sigterm_as_exception():
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load_checkpoint(path: str | os.PathLike[str], **torch_load_kwargs: Any) -> Any:
    """Read a checkpoint written by ``save_checkpoint``; raise CheckpointError if it is damaged."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size:
        raise CheckpointError(f"{path}: {len(data)} bytes is too short for a Sonar checkpoint (truncated?)")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a Sonar checkpoint (magic {magic!r}); plain torch.save files load with torch.load")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: payload is {len(payload)} bytes, header says {length} (truncated or extended)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupted")
    return torch.load(io.BytesIO(payload), **torch_load_kwargs)
