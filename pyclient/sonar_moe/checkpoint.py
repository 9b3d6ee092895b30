"""Checkpoint files that are written atomically and checked on load.

``save_checkpoint(path, obj)`` serializes ``obj`` with ``torch.save`` (for example
``{"model": model.state_dict(), "opt": opt.state_dict()}``), writes it to a temporary file
in the same directory with a SHA-256 of the payload, fsyncs, renames it over ``path`` and
fsyncs the directory: a crash leaves either the old or the new checkpoint, never a torn
one. ``load_checkpoint(path)`` verifies the checksum before unpickling anything.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import tempfile
from typing import Any

import torch

MAGIC = b"SONARCK1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted, or not a Sonar checkpoint."""


def save_checkpoint(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` (anything ``torch.save`` takes) to ``path``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".sonar-ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
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
