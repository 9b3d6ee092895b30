"""torch's OpenMP threads while the trainer waits for sonard.

With ``ring_layers=0`` the hook that sends a layer's request waits for it, and ``step()`` waits
for the last updates. libgomp (the OpenMP runtime of torch's Linux wheels) lets a thread that
ran out of work spin for several milliseconds before it sleeps, so while the trainer waits,
torch's other threads spin on the cores sonard's update needs (docs/benchmarks.md, "torch's
OpenMP threads: spinning or sleeping").

``OpenMPPark`` stops that without the environment: while the trainer's main thread waits for a
reply, it opens an OpenMP parallel region on torch's own team whose other threads block in
``sem_wait``, and posts the semaphore once for each when the reply is in. The team sleeps in
the kernel instead of spinning. ``GOMP_SPINCOUNT`` (read when libgomp is loaded, so set before
Python starts) is the other way; where it or ``OMP_WAIT_POLICY`` is set, or
``SONAR_OPENMP_PARK=0``, nothing is parked.

While the posts wake the parked threads, ``Steering`` keeps them off the posting thread's CPU
once a release has been slow (``SONAR_OPENMP_STEER``: 1 from the start, 0 never): on a virtual
machine whose idle CPUs halt, a woken thread queued there preempted the poster and spun in
libgomp's barrier for it, milliseconds a wait (docs/benchmarks.md, "Ending a park").
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

log = logging.getLogger("sonar_moe")

# The C signature of a parallel region's body: void fn(void *data).
_REGION_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

PARK_ENV = "SONAR_OPENMP_PARK"
STEER_ENV = "SONAR_OPENMP_STEER"

# A receive: recv(timeout) is the next reply's bytes, or None when none came within timeout
# seconds (0: do not wait).
Receive = Callable[[float], "bytes | None"]


def default_spin_runtime(environ: Mapping[str, str] = os.environ, maps_path: str = "/proc/self/maps",
                         prefer: str | None = None) -> str | None:
    """The file of the libgomp loaded in this process when its spin-wait is left at the default
    (neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` set), else None (another runtime, or
    none, or one already told how long to spin). Where several are loaded (another package may
    bring its own), the one under ``prefer`` (torch's library directory by default) is torch's."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return None
    if prefer is None:
        prefer = os.path.join(os.path.dirname(torch.__file__), "lib") + os.sep
    found: list[str] = []
    try:
        with open(maps_path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and "libgomp" in os.path.basename(fields[-1]) and fields[-1] not in found:
                    found.append(fields[-1])
    except OSError:
        return None
    ours = [path for path in found if path.startswith(prefer)]
    if ours:
        return ours[0]
    return found[0] if found else None


class Waiter(Protocol):
    """How a connection waits for a reply."""

    @property
    def parks(self) -> int:
        """Waits that parked torch's threads."""

    @property
    def steered(self) -> int:
        """Parks whose threads were kept off the waiting thread's CPU while woken."""

    def receive(self, recv: Receive, timeout: float) -> bytes | None:
        """recv(timeout), however this waiter waits."""


class DirectWait:
    """The calling thread receives; torch's threads do as they like."""

    parks = 0
    steered = 0

    def receive(self, recv: Receive, timeout: float) -> bytes | None:
        return recv(timeout)


class Steering:
    """Keeps the parked threads off the waiting thread's CPU while the posts wake them.

    A post wakes a parked thread, and Linux chooses the CPU it wakes on. On a virtual machine
    whose idle CPUs halt, a halted CPU reads as preempted by the host and is passed over, so after
    an idle gap of tens of milliseconds the woken thread is queued on the posting thread's own
    CPU and preempts it before it has closed the region; it then reaches libgomp's end-of-region
    barrier first and spins there, waiting for the very thread it displaced, until its spin count
    runs out: milliseconds instead of tens of microseconds (bench/park.py; docs/benchmarks.md,
    "Ending a park"). Steering, each parked thread's CPU mask leaves out the poster's CPU for the
    posts and is put back once the region is closed; a thread whose mask holds no other CPU is
    left as it is. That costs each park a few microseconds a thread (two system calls each) and
    a wake-up on another CPU, so by default (mode "auto") it starts once a release has taken
    longer than SLOW_RELEASE_S, the sign of that machine; "on" steers from the first park, "off"
    never (``SONAR_OPENMP_STEER`` 1 or 0)."""

    SLOW_RELEASE_S = 0.001  # a release this long: a woken thread held the poster's CPU

    def __init__(self, find_team: Callable[[int], list[int]], mode: str = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"steering mode {mode!r}: auto, on or off")
        self.mode = mode
        self.active = mode == "on"  # steering the posts now
        self._find_team = find_team  # native ids of a team of n threads, without the caller
        self._tids: list[int] = []
        self._pid = 0  # the process the ids are of (a forked child learns its own)
        libc = ctypes.CDLL(None, use_errno=True)
        self._getcpu = libc.sched_getcpu
        self._getcpu.restype = ctypes.c_int
        self.steered = 0  # posts made with the parked threads kept off the poster's CPU
        self.slow_releases = 0  # releases that took longer than SLOW_RELEASE_S

    def prepare(self, threads: int) -> None:
        """Learns the ids of the team's other threads (outside a parallel region), once per team size."""
        if self.active and (len(self._tids) != threads - 1 or self._pid != os.getpid()):
            self._tids, self._pid = self._find_team(threads), os.getpid()

    def away(self) -> list[tuple[int, set[int]]]:
        """Moves the team's other threads off this thread's CPU; their former masks."""
        cpu = self._getcpu() if self.active else -1  # prepare() learnt this process's team
        if cpu < 0:
            return []
        held: list[tuple[int, set[int]]] = []
        try:
            for tid in self._tids:
                mask = os.sched_getaffinity(tid)
                if cpu in mask and len(mask) > 1:
                    os.sched_setaffinity(tid, mask - {cpu})
                    held.append((tid, mask))
        except OSError as e:  # a thread gone (the team shrank): learn the team again next time
            log.debug("cannot steer torch's OpenMP threads: %s", e)
            self._tids = []
        if held:
            self.steered += 1
        return held

    @staticmethod
    def back(held: list[tuple[int, set[int]]]) -> None:
        """Puts back the masks away() changed."""
        for tid, mask in held:
            try:
                os.sched_setaffinity(tid, mask)
            except OSError as e:
                log.debug("cannot restore the CPU mask of thread %d: %s", tid, e)

    def released(self, seconds: float) -> None:
        """Notes how long a release (posts and close of the region) took; in mode auto, the
        first slow one starts the steering."""
        if seconds <= self.SLOW_RELEASE_S:
            return
        self.slow_releases += 1
        if self.mode == "auto" and not self.active:
            self.active = True
            log.info("releasing torch's parked OpenMP threads took %.1f ms (a woken thread held this thread's "
                     "CPU); keeping them off it while they are woken from now on (SONAR_OPENMP_STEER=0 "
                     "turns this off)", seconds * 1e3)


class OpenMPPark:
    """Waits with the main thread's OpenMP team (torch's threads) parked in ``sem_wait``.

    The wait opens a parallel region on torch's team (``GOMP_parallel_start``, the entry point
    of code compiled by GCC before 4.9, which every libgomp keeps): the team's other threads
    run ``sem_wait``, the calling thread receives as it would, then posts the semaphore once
    for each of them and closes the region (``GOMP_parallel_end``). Only the main thread parks
    (its team is the one torch's operators use; another thread would get a team of new
    threads), only outside a parallel region, only when the team has more than one thread and
    no reply is waiting already. Nothing but the receive runs inside the region."""

    def __init__(self, libgomp_path: str, steer: str = "auto") -> None:
        gomp = ctypes.CDLL(libgomp_path)  # the copy torch loaded: dlopen gives the same handle
        self._start = gomp.GOMP_parallel_start
        self._start.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._start.restype = None
        self._end = gomp.GOMP_parallel_end
        self._end.argtypes = []
        self._end.restype = None
        self._max_threads = gomp.omp_get_max_threads
        self._max_threads.restype = ctypes.c_int
        self._num_threads = gomp.omp_get_num_threads
        self._num_threads.restype = ctypes.c_int
        self._level = gomp.omp_get_level  # parallel regions around the caller, active or not
        self._level.restype = ctypes.c_int
        libc = ctypes.CDLL(None, use_errno=True)
        self._sem_init = libc.sem_init
        self._sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        self._sem_post = libc.sem_post
        self._sem_post.argtypes = [ctypes.c_void_p]
        self._sem_wait = ctypes.cast(libc.sem_wait, ctypes.c_void_p).value
        self._sem = (ctypes.c_ulonglong * 8)()  # a sem_t (32 bytes on glibc) with room to spare
        self._sem_addr = ctypes.addressof(self._sem)
        self._parallel = gomp.GOMP_parallel
        self._parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._parallel.restype = None
        self.parks = 0  # waits that parked the team
        self.steering = Steering(self._team_ids, steer)

    @classmethod
    def find(cls, environ: Mapping[str, str] = os.environ, maps_path: str = "/proc/self/maps") -> OpenMPPark | None:
        """A park for this process's libgomp when it spins at its default, else None (another
        runtime, or a spin already set, or ``SONAR_OPENMP_PARK=0``)."""
        if environ.get(PARK_ENV, "1") == "0":
            return None
        path = default_spin_runtime(environ, maps_path)
        if path is None:
            return None
        try:
            return cls(path, steer={"0": "off", "1": "on"}.get(environ.get(STEER_ENV, ""), "auto"))
        except (OSError, AttributeError) as e:  # a libgomp without these entry points
            log.debug("cannot park OpenMP threads with %s: %s", path, e)
            return None

    @property
    def steered(self) -> int:
        """Parks whose threads were kept off the waiting thread's CPU while woken."""
        return self.steering.steered

    def team(self) -> int:
        """Threads a parallel region opened here now would have (1: nothing to park)."""
        if threading.current_thread() is not threading.main_thread() or self._level():
            return 1
        return int(self._max_threads())

    def receive(self, recv: Receive, timeout: float) -> bytes | None:
        threads = self.team()
        if threads < 2:
            return recv(timeout)
        got = recv(0.0)
        if got is not None:
            return got
        return self.park(lambda: recv(timeout), threads)

    def park(self, job: Callable[[], bytes | None], threads: int) -> bytes | None:
        """job() with the other threads of a team of `threads` asleep; job's result."""
        self.steering.prepare(threads)
        self._sem_init(self._sem_addr, 0, 0)  # drops posts a smaller team left
        self.parks += 1
        try:
            self._start(self._sem_wait, self._sem_addr, threads)
            return job()
        finally:
            # Closed only if it opened: an interrupt (KeyboardInterrupt) may come before.
            if self._level():
                held = self.steering.away()
                t0 = time.perf_counter()
                try:
                    for _ in range(int(self._num_threads()) - 1):
                        self._sem_post(self._sem_addr)
                    self._end()
                finally:
                    self.steering.back(held)
                self.steering.released(time.perf_counter() - t0)

    def _team_ids(self, threads: int) -> list[int]:
        """The native ids of the threads other than this one in a parallel region of `threads`
        opened here: the team torch's operators run on (libgomp keeps its threads)."""
        seen: list[int] = []
        lock = threading.Lock()

        def body(_: int | None) -> None:
            with lock:
                seen.append(threading.get_native_id())
        fn = _REGION_BODY(body)  # referenced until the region is over
        self._parallel(ctypes.cast(fn, ctypes.c_void_p), None, threads, 0)
        return sorted(set(seen) - {threading.get_native_id()})


def torch_uses_openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (its Linux wheels); another backend's
    (native, TBB) would not be the team a park holds."""
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def choose_waiter(threads: int, environ: Mapping[str, str] = os.environ) -> Waiter:
    """OpenMPPark where torch runs several OpenMP threads of a libgomp that spins at its
    default (and SONAR_OPENMP_PARK is not 0), else DirectWait."""
    if threads < 2 or not torch_uses_openmp():
        return DirectWait()
    park = OpenMPPark.find(environ)
    return park if park is not None else DirectWait()
