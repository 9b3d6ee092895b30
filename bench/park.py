"""What ending a park of torch's OpenMP threads costs, after the team was busy and after it sat
idle (sonar_moe/_openmp.py's OpenMPPark: while the trainer's main thread waits for a reply,
torch's other OpenMP threads block in sem_wait inside a parallel region, and once the reply is in
the main thread posts the semaphore and closes the region). Prints one JSON document.

Each round runs a torch op on the team, then waits `gap` seconds, then parks the team around a
1 ms job (a stand-in for the wait for sonard's reply) and times, from the job's end, how long
releasing the team takes (the posts and the close of the region). Three variants, each in a
fresh process: the park steering from the start (SONAR_OPENMP_STEER=1: its threads kept off the
main thread's CPU while the posts wake them; Sonar's default starts so after a first slow
release), the same with SONAR_OPENMP_STEER=0 (left where Linux wakes them: on a halted
virtual machine, the main thread's own CPU, where the woken thread preempts it and spins in
libgomp's barrier for the very thread it preempted), and torch's other threads pinned off the
main thread's CPU for the whole run (sched_setaffinity).

    .venv/bin/python bench/park.py --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import common
import torch


def pin_apart() -> None:
    """This thread on the first CPU it may use, every other thread of the process on the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pinned needs two CPUs")
    main = threading.get_native_id()
    os.sched_setaffinity(0, {cpus[0]})
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != main:
            os.sched_setaffinity(int(tid), set(cpus[1:]))


def measure(gaps: list[float], rounds: int, pinned: bool) -> dict:
    from sonar_moe._openmp import OpenMPPark

    park = OpenMPPark.find()  # SONAR_OPENMP_STEER from the environment
    threads = torch.get_num_threads()
    if park is None or threads < 2:
        return {"skipped": "no libgomp team to park (one thread, another runtime, or GOMP_SPINCOUNT set)"}
    a = torch.randn(256, 256)
    a = torch.tanh(a @ a)  # the team exists before it is pinned
    if pinned:
        pin_apart()
    out: dict = {"threads": threads, "pinned": pinned, "steering": park.steering.mode, "gaps": {}}
    for gap in gaps:
        release: list[float] = []
        for _ in range(rounds):
            a = torch.tanh(a @ a) / 16  # the team ran an op, as backward's do
            if gap:
                time.sleep(gap)
            end = [0.0]

            def job() -> None:
                time.sleep(0.001)
                end[0] = time.perf_counter()

            park.park(job, threads)
            release.append(time.perf_counter() - end[0])
        out["gaps"][str(gap)] = {"release_s": release, "p50_s": common.median(release),
                                 "over_1ms": sum(x > 1e-3 for x in release)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps", default="0,0.005,0.04", help="idle seconds before each park, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--pinned", action="store_true", help="(one variant) torch's other threads off this CPU")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single variant, in this process
    a = ap.parse_args()
    gaps = [float(x) for x in a.gaps.split(",")]
    if a.one:
        print(json.dumps(measure(gaps, a.rounds, a.pinned)))
        return
    # Each variant in a fresh process: pinning cannot be undone for threads libgomp keeps.
    res = {}
    for name, steer, pinned in (("steered", "1", False), ("unsteered", "0", False), ("pinned", "0", True)):
        cmd = [sys.executable, __file__, "--one", "--gaps", a.gaps, "--rounds", str(a.rounds)]
        cmd += ["--pinned"] if pinned else []
        env = {**os.environ, "SONAR_OPENMP_STEER": steer}
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        res[name] = json.loads(done.stdout)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
