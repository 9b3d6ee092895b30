"""How much of a round trip is waking halted virtual CPUs: bench/kernel.py's transport
measurements (a ping through SonarAdamW's client over ZeroMQ and over unix://, the same request
with bare pyzmq, a Go ZeroMQ echo, a Go Unix-socket echo, a 64-element step) with the guest's
halt polling as the machine has it and with it on, in alternating rounds, each round fresh
processes. Prints one JSON document; with --into, also stores it as "haltpoll" in a saved
benchmark run (bench/results/full.json) for `bench/run.py --report-only` to render.

    sudo .venv/bin/python bench/haltpoll.py --poll-ns 200000 --rounds 3 --into bench/results/full.json

This changes a setting of the virtual machine, not of Sonar: Linux's cpuidle driver for KVM
guests (haltpoll) lets an idle virtual CPU poll for guest_halt_poll_ns before it halts; at 0 it
halts at once, and waking it again is a trip through the host (an interrupt to a halted vCPU,
the host scheduling its thread). With polling on, a wake-up that comes within the window finds
the vCPU running. The polling time is CPU time the host gives the idle guest. Needs root to
write /sys/module/haltpoll/parameters/guest_halt_poll_ns; the value the machine had is restored
at exit. Not part of `make bench` (it must not change the machine it runs on unasked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import common
from common import ROOT

PARAM = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
# The readings compared (p50 of a round trip, median of a small step), from kernel.transport's JSON.
PATHS = {
    "client": ("ping", "layers", "client", "p50_s"),
    "client_unix": ("ping", "layers", "client_unix", "p50_s"),
    "pyzmq": ("ping", "layers", "pyzmq", "p50_s"),
    "echo": ("ping", "layers", "echo", "p50_s"),
    "unix": ("ping", "layers", "unix", "p50_s"),
    "step_small": ("step_small", "median_s"),
    "step_small_unix": ("step_small_unix", "median_s"),
}


def dig(doc: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc if isinstance(doc, (int, float)) else None


def transport_once(pings: int, go_bench: str) -> dict:
    return common.run_json([sys.executable, str(ROOT / "bench" / "kernel.py"), "--transport-only",
                            "--pings", str(pings), "--go-bench", go_bench])


def measure(poll_ns: int, rounds: int, pings: int, go_bench: str) -> dict:
    original = PARAM.read_text().strip()
    settings = {"machine": int(original), "polling": poll_ns}
    got: dict[str, dict[str, list[float]]] = {name: {k: [] for k in PATHS} for name in settings}
    try:
        for _ in range(rounds):
            for name, ns in settings.items():
                PARAM.write_text(str(ns))
                doc = transport_once(pings, go_bench)
                for key, path in PATHS.items():
                    v = dig(doc, path)
                    if v is not None:
                        got[name][key].append(v)
    finally:
        PARAM.write_text(original)
    return {
        "poll_ns": settings,
        "rounds": rounds,
        "pings": pings,
        "cpu_idle": common.cpu_idle(),
        "median_s": {name: {k: common.median(v) for k, v in rows.items() if v} for name, rows in got.items()},
        "rounds_s": got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--poll-ns", type=int, default=200_000, help="guest_halt_poll_ns while polling")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--go-bench", default=str(ROOT / "bin" / "sonar-bench"))
    ap.add_argument("--into", help="a saved run (bench/results/full.json) to store the result in")
    a = ap.parse_args()
    if not PARAM.exists():
        sys.exit(f"haltpoll: {PARAM} missing: this machine's idle CPUs do not use the haltpoll driver")
    idle = common.cpu_idle()
    if not common.halt_polling_applies(idle):
        sys.exit(f"haltpoll: the cpuidle driver here is {idle.get('driver', 'unknown')!r}, not 'haltpoll': "
                 f"{PARAM.name} has no effect on how an idle CPU waits, so there is nothing to compare")
    if not os.access(PARAM, os.W_OK):
        sys.exit(f"haltpoll: {PARAM} is not writable: run as root")
    out = measure(a.poll_ns, a.rounds, a.pings, a.go_bench)
    print(json.dumps(out, indent=1))
    if a.into:
        saved = json.loads(Path(a.into).read_text())
        saved["haltpoll"] = out
        Path(a.into).write_text(json.dumps(saved))


if __name__ == "__main__":
    main()
