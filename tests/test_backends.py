"""The CUDA expert backend without a GPU: a fake connection records the requests it would
send and a fake IPC layer stands in for CUDA handles and events, so the path's logic
(registration, one request per layer with wait_event, accumulation, holders released after
the reply, state transfer, close) runs on any machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from sonar_moe import SonarError
from sonar_moe import _backend, _cuda_backend
from sonar_moe._backend import BackendOptions, ServerBackend
from sonar_moe._openmp import DirectWait
from sonar_moe._cuda_backend import CudaBackend


class FakeConn:
    """Answers every request at once; step replies arrive at the next poll."""

    address = "ipc:///fake/sonard.sock"
    process = None
    server_alive = True

    def __init__(self, hello: dict[str, Any]) -> None:
        self.hello = hello
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.replies: list[Callable[[dict[str, Any]], None] | None] = []
        self.latencies: list[float] = []
        self.waiter = DirectWait()  # as a Connection's: the CUDA path never parks
        self.ended = 0
        self.next_id = 0

    @property
    def in_flight(self) -> int:
        return len(self.replies)

    def call(self, op: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        self.calls.append((op, body))
        if op == "hello":
            return self.hello
        if op == "register":
            ids = list(range(self.next_id + 1, self.next_id + 1 + len(body["tensors"])))
            self.next_id += len(ids)
            return {"ids": ids}
        return {}

    def send(self, op: str, body: dict[str, Any], on_reply: Callable[[dict[str, Any]], None] | None = None) -> int:
        self.sent.append((op, body))
        self.replies.append(on_reply)
        return len(self.sent)

    def poll(self, timeout: float = 0.0) -> int:
        replies, self.replies = self.replies, []
        for r in replies:
            if r is not None:
                r({"ok": True, "body": {}})
        return len(replies)

    def wait(self, rid: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        self.poll()
        return {} if rid is None else {"ok": True, "body": {}}

    def wait_any(self, timeout: float | None = None) -> None:
        self.poll()

    def end_session(self) -> None:
        self.ended += 1


class FakeIpc:
    """CudaIpc's interface over CPU tensors: segment 7 for parameters, 9 for everything shared later."""

    instances: list[FakeIpc] = []

    def __init__(self, conn: FakeConn, device: torch.device) -> None:
        conn.call("cuda_event", {"handle": b"event"})
        self.device = device
        self.records = 0
        self.syncs = 0
        self.shared: list[torch.Tensor] = []
        self.released: list[torch.Tensor] = []
        self.closed = False
        FakeIpc.instances.append(self)

    def param_ref(self, p: torch.Tensor) -> dict[str, int]:
        return {"seg": 7, "off": 4096 * len(self.shared), "nbytes": p.numel() * p.element_size()}

    def grad_ref(self, g: torch.Tensor) -> tuple[dict[str, int], list[Any]]:
        self.shared.append(g)
        return {"seg": 9, "off": 512, "nbytes": g.numel() * g.element_size()}, [g, ("rc", 0)]

    def record(self) -> None:
        self.records += 1

    def synchronize(self) -> None:
        self.syncs += 1

    def release(self, holder: list[Any]) -> None:
        self.released.append(holder[0])
        holder[0] = holder[1] = None

    def close(self) -> None:
        self.closed = True


HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}


def experts() -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [(f"layers.0.moe.experts.{i}.w", nn.Parameter(torch.randn(4, 6, generator=g))) for i in range(2)]


class Steps:
    """The optimizer's side of accumulation: a step counter per tensor."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def advance(self, p: nn.Parameter) -> tuple[int, dict[str, Any]]:
        self.count[id(p)] = self.count.get(id(p), 0) + 1
        return self.count[id(p)], {"step_of": self.count[id(p)]}

    def retreat(self, p: nn.Parameter, step: int) -> None:
        self.count[id(p)] = step - 1


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[ServerBackend, FakeConn, FakeIpc]]:
    FakeIpc.instances.clear()
    monkeypatch.setattr(_cuda_backend, "CudaIpc", FakeIpc)
    monkeypatch.setattr(CudaBackend, "_check_devices", classmethod(lambda cls, devices: None))  # CPU tensors here

    def open_(named: list[tuple[str, nn.Parameter]], conn: FakeConn | None = None,
              **options: Any) -> tuple[ServerBackend, FakeConn, FakeIpc]:
        conn = conn or FakeConn({"server": "fake", "sqrt": "ieee", "cuda": "Fake GPU"})
        monkeypatch.setattr(_backend, "connect", lambda server, timeout: conn)
        backend = CudaBackend.open(None, named, BackendOptions(**options), lambda p: HYPER, Steps())
        return backend, conn, FakeIpc.instances[-1]

    return open_


def test_registers_in_place_and_steps_one_layer_per_request(fake: Callable[..., Any]) -> None:
    named = experts()
    backend, conn, ipc = fake(named)
    ops = [op for op, _ in conn.calls]
    assert ops == ["hello", "cuda_event", "register"]
    assert "sqrt_lib" not in conn.calls[0][1]  # the device kernels do not use the CPU sqrt
    specs = conn.calls[2][1]["tensors"]
    assert [s["param"]["seg"] for s in specs] == [7, 7] and [s["shape"] for s in specs] == [[4, 6], [4, 6]]
    for _, p in named:
        p.grad = torch.ones_like(p)
        backend.hand_over(p, p.grad, owned=True)
        assert p.grad is None
    assert ipc.records == 2
    assert len(conn.sent) == 1  # the layer's two tensors in one request, ordered by the event
    op, body = conn.sent[0]
    assert op == "step" and body["wait_event"] is True
    assert [(i["tensor"], i["apply"], i["step"], i["grad"]["seg"]) for i in body["items"]] == [(1, True, 1, 9), (2, True, 1, 9)]
    assert ipc.released == []  # the gradients stay alive until the reply
    backend.drain()
    assert len(ipc.released) == 2 and conn.in_flight == 0
    assert backend.stats()["grads_sent"] == 2 and backend.stats()["ring_bytes"] == 0
    backend.close()
    assert conn.ended == 1 and ipc.closed


def test_accumulation_leftovers_and_clipping_a_callers_gradient(fake: Callable[..., Any]) -> None:
    named = experts()
    backend, conn, ipc = fake(named, grad_accumulation_steps=2, max_expert_grad_norm=None)
    p0 = named[0][1]
    g = torch.full_like(p0, 3.0)
    backend.hand_over(p0, g, owned=False)  # micro-batch 1 of 2, only one tensor of the layer
    backend.drain()  # sends the incomplete layer, then applies the leftover without a gradient
    bodies = [b for _, b in conn.sent]
    assert [[(i["apply"], i["grad"]["seg"]) for i in b["items"]] for b in bodies] == [[(False, 9)], [(True, 0)]]
    assert all(b["wait_event"] for b in bodies)
    assert torch.equal(g, torch.full_like(p0, 3.0))

    named2 = experts()
    backend2, _, ipc2 = fake(named2, max_expert_grad_norm=1.0)
    p = named2[0][1]
    g = torch.full_like(p, 3.0)
    backend2.hand_over(p, g, owned=False)
    assert torch.equal(g, torch.full_like(p, 3.0))  # the caller's gradient is untouched
    shared = ipc2.shared[-1]
    assert shared.data_ptr() != g.data_ptr()
    torch.testing.assert_close(torch.linalg.vector_norm(shared), torch.tensor(1.0))


def test_state_transfer_uses_device_buffers(fake: Callable[..., Any]) -> None:
    named = experts()
    backend, conn, ipc = fake(named)
    with backend.state_transfer(amsgrad=False) as xfer:
        st = xfer.fetch(named[0][1])
        assert sorted(st) == ["exp_avg", "exp_avg_sq"]
        xfer.store_all([(named[1][1], 5, {"exp_avg": torch.ones(4, 6), "exp_avg_sq": None})])
        with pytest.raises(ValueError, match="has shape"):
            xfer.store_all([(named[1][1], 5, {"exp_avg": torch.ones(3)})])
    exports = [b for op, b in conn.sent if op == "export"]
    imports = [b for op, b in conn.sent if op == "import"]
    assert len(exports) == 1 and len(imports) == 1 and imports[0]["step"] == 5
    assert exports[0]["max_exp_avg_sq"] == {"seg": 0, "off": 0, "nbytes": 0}
    assert exports[0]["exp_avg"]["seg"] == 9 and ipc.syncs == 2
    assert len(ipc.released) == len(ipc.shared)  # every buffer given back at the end


def test_a_server_without_cuda_is_refused_and_the_session_ended(fake: Callable[..., Any]) -> None:
    conn = FakeConn({"server": "fake", "sqrt": "ieee"})
    with pytest.raises(SonarError, match="no CUDA path"):
        fake(experts(), conn=conn)
    assert conn.ended == 1


def test_store_all_waits_for_every_reply_and_reports_those_taken(fake: Callable[..., Any]) -> None:
    """A batch's imports are all sent before any reply is read; one refused in the middle is
    raised after the last reply (none left unanswered), naming the server's reason, and the
    caller hears of each tensor the server did take, those after the refused one too."""
    named = [(f"layers.0.moe.experts.{i}.w", nn.Parameter(torch.randn(4, 6))) for i in range(4)]
    backend, conn, _ = fake(named)
    waited: list[int] = []
    refuse = {}

    def wait(rid: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        assert len(conn.sent) == 4, "a reply was waited for before the batch was sent"
        waited.append(rid or 0)
        return {"ok": False, "error": "no room"} if rid in refuse else {"ok": True, "body": {}}

    conn.wait = wait
    refuse[2] = True  # the second tensor's import
    taken: list[nn.Parameter] = []
    with backend.state_transfer(amsgrad=False) as xfer:
        with pytest.raises(SonarError, match="sonard refused import: no room"):
            xfer.store_all([(p, 3, {"exp_avg": torch.ones(4, 6)}) for _, p in named], taken.append)
    assert waited == [1, 2, 3, 4]
    assert taken == [named[0][1], named[2][1], named[3][1]]
    assert [b["step"] for op, b in conn.sent] == [3, 3, 3, 3]
