"""Parking torch's OpenMP threads while the trainer waits for sonard (sonar_moe/_openmp.py).

libgomp lets an idle thread spin for milliseconds; while a gradient hook waits for sonard that
spinning takes a core the update needs. OpenMPPark opens a parallel region on torch's own team
whose other threads sleep in sem_wait until the reply is in. These tests look at the threads
themselves (/proc/self/task/*/stat: R running or runnable, S asleep), at what a park returns
or raises, and at training with a real sonard, bitwise against torch.optim.AdamW."""

from __future__ import annotations

import copy
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import sonar_moe
from sonar_moe._openmp import (DirectWait, OpenMPPark, Steering, choose_waiter, default_spin_runtime,
                               torch_uses_openmp)

from moe_util import TinyMoE, assert_same_params, train_beside

MAPS = Path("/proc/self/maps").read_text()
pytestmark = pytest.mark.skipif("libgomp" not in MAPS, reason="this torch does not use libgomp")

THREADS = 2


@pytest.fixture()
def two_threads() -> Iterator[None]:
    """torch on two OpenMP threads for the test (a team with a thread to park)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield None
    torch.set_num_threads(before)


def in_region(fn: Callable[[], None]) -> None:
    """fn() on each thread of a parallel region of THREADS opened here (torch's libgomp)."""
    path = default_spin_runtime({})
    assert path is not None
    gomp = ctypes.CDLL(path)
    lock = threading.Lock()

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def body(_: int) -> None:
        with lock:
            fn()

    gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel(ctypes.cast(body, ctypes.c_void_p), None, THREADS, 0)


def team_tids() -> list[int]:
    """The native ids of the main thread's OpenMP team other than itself, from a region of its
    own (the team torch's operators run on)."""
    seen: list[int] = []
    in_region(lambda: seen.append(threading.get_native_id()))
    others = sorted(set(seen) - {threading.get_native_id()})
    assert len(others) == THREADS - 1, seen
    return others


def cpu_ns(tids: list[int]) -> int:
    """Nanoseconds the threads tids have run on a CPU (schedstat's first field)."""
    return sum(int(Path(f"/proc/self/task/{t}/schedstat").read_text().split()[0]) for t in tids)


def busy() -> None:
    """A torch operator on the whole team; its threads spin (libgomp's default) after it."""
    x = torch.arange(1 << 21, dtype=torch.float32)
    assert (x * 2).sum().item() == float((1 << 21) * ((1 << 21) - 1))


def sampler(tids: list[int], wait: float) -> Callable[[], bytes]:
    """A job that waits `wait` seconds and returns how long (us) tids ran meanwhile."""
    def job() -> bytes:
        t0 = cpu_ns(tids)
        time.sleep(wait)
        return str((cpu_ns(tids) - t0) // 1000).encode()
    return job


def us(reply: bytes | None) -> int:
    """The microseconds a sampler's job returned through a wait or a park."""
    assert reply is not None
    return int(reply)


WAIT = 0.02  # s: a layer's update on these machines is a few milliseconds


def test_parked_threads_sleep(two_threads: None) -> None:
    """Right after an operator torch's other thread spins through a plain wait (milliseconds of
    CPU); through a park it sleeps (what it runs to get into sem_wait: microseconds), and it
    runs the next operator as before."""
    park = OpenMPPark.find({})
    assert park is not None
    tids = team_tids()
    spun, parked = [], []
    for _ in range(5):
        busy()
        spun.append(us(DirectWait().receive(lambda _t: sampler(tids, WAIT)(), WAIT)))
        busy()
        parked.append(us(park.receive(lambda t: None if t == 0 else sampler(tids, WAIT)(), WAIT)))
    assert max(spun) > 2000, spun  # the control: without a park the thread spins (us of CPU)
    # On a loaded machine one sample in five may still show a millisecond of CPU (seen once in
    # CI's unix run: [0, 1059, 0, 0, 0]; its cause is not known); a park that did not work
    # leaves every sample spinning, as the control does.
    assert sum(p < 500 for p in parked) >= 4, parked
    assert park.parks == 5


def test_park_returns_raises_and_leaves_no_post(two_threads: None) -> None:
    """A park returns what the receive returned, raises what it raised, and leaves the
    semaphore at zero: the next park's threads sleep again."""
    park = OpenMPPark.find({})
    assert park is not None
    tids = team_tids()
    assert park.park(lambda: b"reply", THREADS) == b"reply"
    with pytest.raises(KeyError, match="lost"):
        park.park(lambda: (_ for _ in ()).throw(KeyError("lost")), THREADS)
    busy()
    assert us(park.park(sampler(tids, WAIT), THREADS)) < 500
    assert park.parks == 3


def test_park_only_where_it_helps(two_threads: None) -> None:
    """No park when a reply is already there, on another thread than the main one (its team
    would be new threads), inside a parallel region (on any of its threads), or with one
    thread."""
    park = OpenMPPark.find({})
    assert park is not None
    assert park.receive(lambda t: b"ready" if t == 0 else None, 0.05) == b"ready"
    assert park.parks == 0
    seen: list[bytes | None] = []
    t = threading.Thread(target=lambda: seen.append(park.receive(lambda _t: b"other", 0.05)))
    t.start()
    t.join()
    assert seen == [b"other"] and park.parks == 0
    inside: list[int] = []
    in_region(lambda: inside.append(park.team()))  # on every thread of a region: main's too
    assert inside == [1] * THREADS
    torch.set_num_threads(1)
    assert park.team() == 1
    assert park.receive(lambda _t: b"alone", 0.05) == b"alone" and park.parks == 0
    torch.set_num_threads(THREADS)
    assert park.team() == THREADS


def release_after(park: OpenMPPark, gap: float) -> float:
    """Seconds from the end of a 1 ms job to the end of its park, the team idle `gap` s before."""
    busy()
    time.sleep(gap)
    end = [0.0]

    def job() -> None:
        time.sleep(0.001)
        end[0] = time.perf_counter()
    park.park(job, THREADS)
    return time.perf_counter() - end[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_release_after_an_idle_gap(two_threads: None) -> None:
    """The thread a post wakes must not land on the posting thread's CPU: on a virtual machine
    whose idle CPUs halt (these), after 40 ms idle it did, preempted the poster and spun in
    libgomp's barrier for it: 2.2 ms p50 to end a park instead of tens of microseconds
    (bench/park.py, 2026-12-04). Steering (by default from the first slow release) keeps the
    park's threads off the poster's CPU while they are woken: here, that it steers when it
    should (always with SONAR_OPENMP_STEER=1, from the first slow release by default)."""
    for env in ({"SONAR_OPENMP_STEER": "1"}, {}):
        park = OpenMPPark.find(env)
        assert park is not None
        times: list[float] = []
        active: list[bool] = []  # whether the steering was on after each release
        for _ in range(12):
            times.append(release_after(park, 0.04))
            active.append(park.steering.active)
        # How long a release takes is measured by bench/park.py, not asserted here: on a loaded
        # machine (CI beside other jobs) any bound is a coin toss (a 2.1 ms median failed one run).
        # On a machine where no release is slow, the default never needs to steer.
        if env:
            assert park.steering.steered == 12, env
            continue
        # The default steers every park after the first release the park itself timed as slow.
        # Its timing (the posts and the close) lies inside this test's (from the end of the job to
        # park()'s return), so a release it found slow the test did too, not always the reverse
        # (a CI run: the test's first release over 1 ms, the park's second).
        started = next((i + 1 for i, on in enumerate(active) if on), len(active))
        assert park.steering.steered == 12 - started, (started, times)
        assert started >= first_slow(times), (started, times)
        assert (park.steering.slow_releases > 0) == any(active), (started, times)


def first_slow(times: list[float]) -> int:
    """Index after the first release over Steering.SLOW_RELEASE_S (len(times) if none)."""
    return next((i + 1 for i, t in enumerate(times) if t > Steering.SLOW_RELEASE_S), len(times))


def test_steering_modes(two_threads: None) -> None:
    """SONAR_OPENMP_STEER: 1 steers from the first park, 0 never, unset once a release was slow;
    anything else is the default."""
    park = OpenMPPark.find({"SONAR_OPENMP_STEER": "1"})
    assert park is not None and park.steering.active
    for env in ({}, {"SONAR_OPENMP_STEER": "yes"}):
        park = OpenMPPark.find(env)
        assert park is not None and park.steering.mode == "auto" and not park.steering.active
        park.steering.released(Steering.SLOW_RELEASE_S / 2)
        assert not park.steering.active and park.steering.slow_releases == 0
        park.steering.released(Steering.SLOW_RELEASE_S * 2)
        assert park.steering.active and park.steering.slow_releases == 1
    off = OpenMPPark.find({"SONAR_OPENMP_STEER": "0"})
    assert off is not None
    off.steering.released(1.0)
    release_after(off, 0.0)
    assert off.parks == 1 and not off.steering.active and off.steering.steered == 0
    with pytest.raises(ValueError, match="auto, on or off"):
        Steering(lambda n: [], "sometimes")


def test_steering_puts_masks_back(two_threads: None) -> None:
    """The parked threads' CPU masks are the same after a park as before; a thread whose mask
    holds one CPU is left as it is (nowhere else to go), and the park still ends."""
    park = OpenMPPark.find({"SONAR_OPENMP_STEER": "1"})
    assert park is not None
    tids = team_tids()
    before = {t: os.sched_getaffinity(t) for t in tids}
    release_after(park, 0.0)
    assert {t: os.sched_getaffinity(t) for t in tids} == before
    assert park.steering.steered == (1 if all(len(m) > 1 for m in before.values()) else 0)
    one = {min(os.sched_getaffinity(0))}
    for t in tids:
        os.sched_setaffinity(t, one)
    try:
        release_after(park, 0.0)
        assert {t: os.sched_getaffinity(t) for t in tids} == {t: one for t in tids}
    finally:
        for t, m in before.items():
            os.sched_setaffinity(t, m)

def test_find_respects_the_environment(tmp_path: Path) -> None:
    """Nothing is parked where the user set libgomp's wait (GOMP_SPINCOUNT, OMP_WAIT_POLICY),
    turned parking off (SONAR_OPENMP_PARK=0), or torch runs another runtime."""
    assert OpenMPPark.find({}) is not None
    for env in ({"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "passive"}, {"SONAR_OPENMP_PARK": "0"}):
        assert OpenMPPark.find(env) is None, env
        assert isinstance(choose_waiter(THREADS, env), DirectWait)
    other = tmp_path / "maps"
    other.write_text("".join(line + "\n" for line in MAPS.splitlines() if "libgomp" not in line))
    assert OpenMPPark.find({}, str(other)) is None
    # another package's libgomp mapped first: torch's (under torch/lib) is the one chosen
    ours = default_spin_runtime({})
    assert ours is not None
    two = tmp_path / "maps2"
    two.write_text("7f0000000000-7f0000001000 r-xp 00000000 00:00 1 /opt/other/libgomp-1234.so.1\n" + MAPS)
    assert default_spin_runtime({}, str(two)) == ours
    assert default_spin_runtime({}, str(two), prefer="/opt/other/") == "/opt/other/libgomp-1234.so.1"
    assert isinstance(choose_waiter(1, {}), DirectWait)
    assert torch_uses_openmp()  # this torch's threads are OpenMP's (libgomp is mapped)
    assert isinstance(choose_waiter(THREADS, {}), OpenMPPark)


@pytest.mark.parametrize("park", [True, False])
def test_training_parks_and_stays_exact(two_threads: None, monkeypatch: pytest.MonkeyPatch, park: bool) -> None:
    """Hooks that wait (ring_layers=0) park the team on torch's default spin, not with
    SONAR_OPENMP_PARK=0; either way the parameters are torch.optim.AdamW's bits."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("SONAR_OPENMP_PARK", "1" if park else "0")
    # Over sonard's own Unix socket the server often answers before the hook's wait begins (its
    # goroutine runs where the trainer's thread ran and takes that CPU during the send), so a wait
    # need not park at all: the park is tested over ZeroMQ, where each wait finds no reply yet.
    monkeypatch.setenv("SONAR_TRANSPORT", "zmq")
    torch.manual_seed(7)
    model = TinyMoE(torch.float32, experts=6, hidden=33, inter=65)
    ref = copy.deepcopy(model)
    opt = sonar_moe.SonarAdamW(model, lr=2e-3, weight_decay=0.1, ring_layers=0, max_grad_norm=1.0)
    topt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.1)
    try:
        # The reference clips the dense parameters only (expert_clipping is off).
        train_beside(model, ref, opt, topt, lambda: torch.randn(64, 33), steps=4,
                     before_ref_step=lambda: torch.nn.utils.clip_grad_norm_(ref.proj.parameters(), 1.0))
        assert_same_params(model, ref)
        parks, steered = opt.stats()["openmp_parks"], opt.stats()["openmp_steered"]
        assert (parks > 0) if park else (parks == 0), parks
        assert 0 <= steered <= parks, (steered, parks)
    finally:
        opt.close()
