"""Where a request's time goes: each reply carries sonard's CLOCK_MONOTONIC readings (received,
decoded, handled), and the client keeps them beside its own (``SonarAdamW.request_traces``), for
the latest requests only.

Real sonard, real ZeroMQ, a real model trained for a few steps."""

from __future__ import annotations

import time

import pytest
import torch

import sonar_moe
from sonar_moe import Connection, RequestTrace
from sonar_moe import _connection

from moe_util import TinyMoE


def ordered(t: RequestTrace) -> bool:
    """The order the request took. ``sent`` is read when the send call returns, which on a busy
    machine may be after the server received it (the thread lost its core on the way out), so it
    is only bounded by the client's own readings."""
    return (t.start <= t.received <= t.decoded <= t.handled <= t.got <= t.woke <= t.done
            and t.start <= t.sent <= t.got)


@pytest.mark.parametrize("ring_layers", [0, 1])
def test_step_traces_ordered(ring_layers: int) -> None:
    """One trace per answered request, each reading in the order the request took (client and
    server share the clock), the step's own server time inside the handling, and the segments
    adding up to the round trip."""
    torch.manual_seed(3)
    model = TinyMoE(torch.float32)
    x = torch.randn(5, 9)
    before = time.monotonic_ns()
    with sonar_moe.SonarAdamW(model.named_parameters(), lr=1e-3, ring_layers=ring_layers) as opt:
        for _ in range(4):
            model(x).backward()
            opt.step()
            opt.zero_grad()
        traces = opt.request_traces
        n_latencies = len(opt.request_latencies)
        st = opt.stats(server=False)
    after = time.monotonic_ns()
    assert st["requests"] == n_latencies  # all of them: fewer than the window
    assert set(st["step_us_p50"]) == set(traces[0].segments())
    assert 0 < st["step_us_p50"]["total"] < (after - before) / 1e3
    steps = [t for t in traces if t.op == "step"]
    assert len(steps) == 4 * 2  # a request per layer per step
    assert len(traces) == n_latencies  # every answered request, the connection's own too
    for t in traces:
        assert ordered(t), t
        assert before <= t.start and t.done <= after, t
        seg = t.segments()
        parts = sum(v for k, v in seg.items() if k != "total")
        assert abs(parts - seg["total"]) < 1e-6, seg
    for t in steps:
        assert t.server_us > 0, t
        # The step's own time is part of the handling (rounded down to a microsecond).
        assert t.server_us * 1000 <= t.handled - t.decoded, t


def test_recent_requests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection keeps the latencies and traces of its latest requests, not of every request
    of a run (millions in a long one)."""
    monkeypatch.setattr(_connection, "RECENT_REQUESTS", 10)
    model = TinyMoE(torch.float32)
    with sonar_moe.SonarAdamW(model.named_parameters(), lr=1e-3) as opt:
        assert opt.server_address is not None
        conn = Connection(opt.server_address, timeout=30)
        try:
            for i in range(25):
                conn.call("ping", {"i": i})
            assert len(conn.latencies) == 10
            assert len(conn.traces) == 10
            assert all(t.op == "ping" and ordered(t) for t in conn.traces)
            # The latest ones: the last trace is the last call's.
            last = conn.traces[-1]
            conn.call("ping", {})
            assert conn.traces[-2] == last and len(conn.traces) == 10
        finally:
            conn.close()


def test_stats_count_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stats()["requests"]`` counts every answered request, also past the window the
    latencies are kept for."""
    monkeypatch.setattr(_connection, "RECENT_REQUESTS", 4)
    torch.manual_seed(4)
    model = TinyMoE(torch.float32)
    x = torch.randn(5, 9)
    with sonar_moe.SonarAdamW(model.named_parameters(), lr=1e-3) as opt:
        for _ in range(3):
            model(x).backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats(server=False)
        assert len(opt.request_latencies) == 4 and len(opt.request_traces) == 4
        assert st["requests"] >= 3 * 2 + 2  # six step requests, the session's own before them
        assert st["step_requests"] == 3 * 2
