"""POSIX shared memory for the client: segments the server maps, and the gradient slot ring."""

from __future__ import annotations

import collections
import errno
import ctypes
import itertools
import mmap
import os
import secrets
import weakref

import torch

from ._connection import SonarError
from . import _fork

SHM_DIR = "/dev/shm"
PAGE = 4096
# Gradient slots start at this offset modulo 4 KiB. Parameters sit at 0 and the
# server's state buffers at the parameter's offset (optimizer.stateOffset); they
# are written while the gradient is only read, and a gradient read 512 bytes
# past them never matches, in its low 12 bits, a write still in the CPU's store
# buffer (4K aliasing, which made the update loop up to 1.7x slower).
SLOT_STAGGER = 512

_counter = itertools.count()

# What each segment holds, for the message when it does not fit.
_PURPOSE = {"params": "the expert parameters", "ring": "the gradient ring",
            "xfer": "the state transfer of state_dict()/load_state_dict()"}


class ShmFullError(SonarError, MemoryError):
    """/dev/shm has no room for a segment the client needs (its pages are reserved up front)."""


def _mib(n: int) -> str:
    """n bytes in binary units ("4.0 KiB", "1.1 MiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def shm_free() -> int:
    """Bytes an unprivileged process may still allocate in SHM_DIR."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _no_room(size: int, tag: str, free: int) -> ShmFullError:
    st = os.statvfs(SHM_DIR)
    return ShmFullError(
        f"sonar: {SHM_DIR} has no room for {_PURPOSE.get(tag, tag)} ({_mib(size)}): {_mib(free)} free of "
        f"{_mib(st.f_blocks * st.f_frsize)}, {_mib(max(size - free, 0))} missing. Free shared memory or enlarge "
        f"{SHM_DIR} (docker run --shm-size, or mount -o remount,size=... {SHM_DIR})")


class Segment:
    """A POSIX shared-memory segment created by this process (mode 0600).

    Every page is reserved when the segment is made (posix_fallocate): a page of a sparse
    segment would be allocated on first touch, and when /dev/shm is full that touch is a
    SIGBUS, in this process or in the server, instead of an error. Room is checked first, and
    a segment that does not fit raises ShmFullError saying how much is missing."""

    def __init__(self, size: int, tag: str) -> None:
        self.size = int(size)
        self.name = f"sonar-{os.getpid()}-{secrets.token_hex(4)}-{next(_counter)}-{tag}"
        self.path = os.path.join(SHM_DIR, self.name)
        free = shm_free()
        if self.size > free:
            raise _no_room(self.size, tag, free)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                os.ftruncate(fd, 0)  # give back what was reserved before measuring
                raise _no_room(self.size, tag, shm_free()) from None
            self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            os.close(fd)
            raise
        # Kept open (the name is unlinked once the server mapped it) so that a forked
        # child can re-map the memory privately (_fork).
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        _fork.track(self)

    def tensor(self, offset: int, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """A tensor view of [offset, offset + numel*itemsize) of the segment."""
        numel = 1
        for d in shape:
            numel *= int(d)
        return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset).view(shape)

    def _after_fork_in_child(self) -> None:
        """In a forked child: replace the shared mapping, at the same address, by a private
        copy-on-write mapping of the same memory, so that the child's writes stay its own."""
        if self.mm.closed:
            return
        view = ctypes.c_char.from_buffer(self.mm)
        addr = ctypes.addressof(view)
        del view
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        map_fixed = 0x10
        got = libc.mmap(addr, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | map_fixed, self._fd, 0)
        if got != addr:
            raise OSError(ctypes.get_errno(), f"sonar: re-mapping {self.name} privately after fork failed")

    def unlink(self) -> None:
        """Remove the name (the server unlinks it once mapped; this covers failures)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Ring:
    """A ring of gradient slots in one segment.

    Slots are handed out in address order. They are usually given back in the
    same order (the server answers a client's requests in order); a slot freed
    early (a later request finished first) is reclaimed once every older slot
    is free, so the free space stays one or two contiguous ranges.
    """

    def __init__(self, capacity: int, tag: str = "ring") -> None:
        self.capacity = max(int(capacity), PAGE)
        self.segment = Segment(self.capacity, tag)
        self._live: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # start -> [end, freed]
        self._head = 0  # the newest slot's end
        self.used = 0  # bytes from the oldest live slot to the newest one's end

    @staticmethod
    def _place(at: int) -> int:
        """First staggered offset at or after `at`."""
        base = (at // PAGE) * PAGE + SLOT_STAGGER
        return base if base >= at else base + PAGE

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        """Upper bound of the ring bytes one slot of nbytes takes."""
        return nbytes + PAGE + SLOT_STAGGER

    def try_alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of nbytes, or None when the ring is full."""
        if not self._live:
            start = self._place(0)
            if start + nbytes > self.capacity:
                return None
        else:
            tail = next(iter(self._live))
            start = self._place(self._head)
            if self._head > tail:  # free: [head, capacity) and [0, tail)
                if start + nbytes > self.capacity:
                    start = self._place(0)
                    if start + nbytes > tail:
                        return None
            elif start + nbytes > tail:  # wrapped: free is [head, tail)
                return None
        self._live[start] = [start + nbytes, 0]
        self._head = start + nbytes
        self._recount()
        return start

    def free(self, start: int) -> None:
        """Give back the slot at `start`."""
        slot = self._live.get(start)
        if slot is None or slot[1]:
            raise RuntimeError(f"sonar: ring slot {start} is not live")
        slot[1] = 1
        while self._live and next(iter(self._live.values()))[1]:
            self._live.popitem(last=False)
        if not self._live:
            self._head = 0
        self._recount()

    def _recount(self) -> None:
        self.used = sum(e - s for s, (e, freed) in self._live.items() if not freed)

    def __len__(self) -> int:
        return len(self._live)
