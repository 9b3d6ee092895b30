"""Churn: many clients that come and go on one shared sonard. Each client connects, says
hello, attaches a segment, registers a tensor, applies one step, and leaves: two in three
close their socket without a goodbye (as a killed trainer does), one in three says bye. The
server's resident memory, open file descriptors, sessions and per-client metric series are
sampled as clients pass; nothing of a client may outlive its session.

    .venv/bin/python scripts/churn.py --clients 10000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pyclient"))

import torch  # noqa: E402

from sonar_moe import Connection, find_sonard, torch_scalars  # noqa: E402
from sonar_moe._shm import Segment  # noqa: E402

GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False}
N = 64


def rss_fds(pid: int) -> tuple[int, int]:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def one_client(addr: str, i: int) -> None:
    conn = Connection(addr, timeout=30)
    seg = Segment(8192, "churn")
    try:
        conn.call("hello", {"client": "churn", "pid": os.getpid(), "torch": torch.__version__, "threads": 1,
                            "capability": ""})
        sid = conn.call("attach", {"shm": seg.name, "size": seg.size})["seg"]
        tid = conn.call("register", {"tensors": [{"name": f"w{i}", "shape": [N], "dtype": "float32",
                                                  "param": {"seg": sid, "off": 0, "nbytes": 4 * N}, "hyper": HYPER}]})["ids"][0]
        conn.call("step", {"items": [{"tensor": tid, "grad": {"seg": sid, "off": 4096, "nbytes": 4 * N}, "apply": True,
                                      "step": 1, "scalars": torch_scalars(GROUP, 1.0)}]})
        if i % 3 == 0:
            conn.call("bye", {})
    finally:
        seg.unlink()
        seg.mm.close()
        conn.close()


def settled(pid: int, timeout: float = 10.0) -> tuple[int, int]:
    """RSS and fds once RSS stops falling: the Go runtime gives freed pages back to the kernel
    gradually after a peak (on a loaded machine, where more sessions overlap, for seconds), and a
    leak is what it cannot give back. Samples every 0.5 s until two differ by under 0.25 MiB."""
    deadline = time.monotonic() + timeout
    time.sleep(0.5)
    rss, fds = rss_fds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now, fds = rss_fds(pid)
        if rss - now < 2**18:
            return min(rss, now), fds
        rss = now
    return rss, fds


def scrape(metrics_url: str) -> dict[str, float]:
    """From the server's metrics: its client series, the Go heap in use and what the last
    collection found live (MiB), and goroutines."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    value = {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}
    return {"series": sum(1 for ln in lines if ln.startswith("sonard_client_")),
            "heap_mib": round(value["go_memstats_heap_inuse_bytes"] / 2**20, 2),
            "live_mib": round(value["go_gc_heap_live_bytes"] / 2**20, 2),
            "goroutines": int(value["go_goroutines"])}


def churn(addr: str, pid: int, clients: int, metrics_url: str | None, samples: int = 10) -> list[dict[str, Any]]:
    """Run the clients; the server's figures after each tenth (and once all sessions are gone)."""
    out = []
    every = max(1, clients // samples)
    t0 = time.monotonic()
    for i in range(clients):
        one_client(addr, i)
        if (i + 1) % every == 0 or i + 1 == clients:
            rss, fds = rss_fds(pid)
            out.append({"clients": i + 1, "seconds": round(time.monotonic() - t0, 1), "rss_mib": round(rss / 2**20, 1),
                        "fds": fds, **(scrape(metrics_url) if metrics_url else {"series": -1})})
    probe = Connection(addr, timeout=30)
    deadline = time.monotonic() + 30
    while (st := probe.call("stats", {}))["sessions"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    probe.close()
    rss, fds = settled(pid)
    out.append({"clients": clients, "seconds": round(time.monotonic() - t0, 1), "rss_mib": round(rss / 2**20, 1),
                "fds": fds, **(quiet_scrape(metrics_url) if metrics_url else {"series": -1}),
                "sessions": st["sessions"], "tensors": st["tensors"], "segments": st["segments"], "final": True})
    return out


def quiet_scrape(metrics_url: str, n: int = 8) -> dict[str, float]:
    """scrape() on a server with no clients, with the least live heap of n scrapes 0.2 s apart:
    go_gc_heap_live_bytes is what the last collection found, which may predate the last clients'
    release until a scrape's own allocations start the next one."""
    rows = []
    for _ in range(n):
        rows.append(scrape(metrics_url))
        time.sleep(0.2)
    return {**rows[-1], "live_mib": min(r["live_mib"] for r in rows)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--grace", default="200ms", help="sonard --reconnect-grace")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sonar-churn-") as d:
        addr = f"ipc://{d}/run/sonard.sock"
        metrics = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen([find_sonard(), "--listen", addr, "--log-level", "error", "--reconnect-grace", args.grace,
                                 "--metrics-addr", metrics])
        try:
            time.sleep(0.5)
            for row in churn(addr, proc.pid, args.clients, f"http://{metrics}/metrics"):
                print(row, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
