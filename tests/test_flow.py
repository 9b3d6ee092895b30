"""Fairness and flow (issue 16, item 6): a client pipelining heavy requests does not starve
another beyond one of its requests (ZeroMQ fair-queues connections, the server serves one
request at a time); past ZeroMQ's high-water mark every request still gets its reply."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from conftest import sonard_command
from sonar_moe import Connection, torch_scalars
from sonar_moe._shm import Segment

GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False}


@pytest.fixture()
def server(sonard_binary: str, tmp_path: Path) -> Iterator[str]:
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    yield addr
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def hello(conn: Connection) -> None:
    conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": torch.__version__, "threads": 1, "capability": ""})


def test_heavy_pipeline_does_not_starve_another_client(server: str) -> None:
    n = 1 << 20  # 4 MiB float32 tensor
    heavy = Connection(server, timeout=120)
    hello(heavy)
    seg = Segment(8 * n + 8192, "heavy")
    sid = heavy.call("attach", {"shm": seg.name, "size": seg.size})["seg"]
    tid = heavy.call("register", {"tensors": [{"name": "w", "shape": [n], "dtype": "float32",
                                               "param": {"seg": sid, "off": 0, "nbytes": 4 * n}, "hyper": HYPER}]})["ids"][0]

    def step(k: int) -> dict[str, object]:
        return {"items": [{"tensor": tid, "grad": {"seg": sid, "off": 4 * n + 4096, "nbytes": 4 * n}, "apply": True,
                           "step": k, "scalars": torch_scalars(GROUP, float(k))}]}

    t0 = time.monotonic()
    heavy.call("step", step(1))
    one = time.monotonic() - t0
    light = Connection(server, timeout=120)
    hello(light)
    requests = 200
    for k in range(2, requests + 2):
        heavy.send("step", step(k))
    lat = []
    while heavy.in_flight:
        t1 = time.monotonic()
        light.call("stats", {})
        lat.append(time.monotonic() - t1)
        heavy.poll(0)
    heavy.wait()
    worst = max(lat)
    print(f"heavy step {one * 1e3:.1f} ms; {requests} pipelined; light client: {len(lat)} round trips, "
          f"median {statistics.median(lat) * 1e3:.1f} ms, max {worst * 1e3:.1f} ms")
    assert len(lat) > 5
    # One heavy request ahead at most (plus scheduling noise on a loaded 2-core machine),
    # never the whole pipeline (200 x one).
    assert worst < 10 * one + 0.2, (one, lat)
    heavy.close()
    light.close()
    seg.mm.close()


def test_replies_past_the_high_water_mark_are_not_dropped(server: str) -> None:
    """A raw client pipelines 5,000 requests before reading: one reply each (executed, or
    "busy: not executed"), none lost. Before, replies past ~2,000 were dropped silently."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 10)
    s.connect(server)
    n = 5000
    for i in range(1, n + 1):
        s.send(msgpack.packb({"v": 1, "op": "nope", "id": i, "body": {}}))
    time.sleep(1.0)
    got: dict[int, str] = {}
    while len(got) < n:
        assert s.poll(10_000), f"only {len(got)} replies of {n}"
        rep = msgpack.unpackb(s.recv())
        assert rep["id"] not in got
        got[rep["id"]] = rep["error"]
    busy = sum(1 for e in got.values() if e.startswith("busy:"))
    assert all(e.startswith("busy:") or "unknown op" in e for e in got.values())
    print(f"{n} requests: {n - busy} executed, {busy} answered busy")
    s.close()
