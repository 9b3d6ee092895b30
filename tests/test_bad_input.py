"""Bad input to a real sonard: each case gets an error reply, the server keeps serving,
and no parameter or optimizer-state byte changes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch

from sonar_moe import SonarError, torch_scalars
from sonar_moe import Connection
from sonar_moe import start_private_server
from sonar_moe._shm import Segment

N = 1000  # elements of the test tensor (float32)
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}


@dataclass
class Rig:
    conn: Connection
    params: Segment
    grads: Segment
    xfer: Segment
    pseg: int
    gseg: int
    xseg: int
    tid: int

    def param_bytes(self) -> bytes:
        return bytes(self.params.mm[: 4 * N])

    def state(self) -> tuple[bytes, bytes, int]:
        rep = self.conn.call("export", {"tensor": self.tid, "step": 0,
                                        "exp_avg": {"seg": self.xseg, "off": 0, "nbytes": 4 * N},
                                        "exp_avg_sq": {"seg": self.xseg, "off": 8192, "nbytes": 4 * N},
                                        "max_exp_avg_sq": {"seg": 0, "off": 0, "nbytes": 0}})
        return bytes(self.xfer.mm[: 4 * N]), bytes(self.xfer.mm[8192: 8192 + 4 * N]), rep["step"]

    def step_item(self, **over: Any) -> dict[str, Any]:
        item = {"tensor": self.tid, "grad": {"seg": self.gseg, "off": 0, "nbytes": 4 * N}, "apply": True,
                "step": 2, "scalars": torch_scalars(GROUP, 2.0)}
        item.update(over)
        return item


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    conn = start_private_server(timeout=10.0)
    conn.call("hello", {"client": "test", "pid": 0, "torch": torch.__version__, "threads": 1, "capability": ""})
    params, grads, xfer = Segment(8192, "p"), Segment(8192, "g"), Segment(16384, "x")
    g = torch.Generator().manual_seed(0)
    params.tensor(0, torch.float32, (N,)).copy_(torch.randn(N, generator=g))
    grads.tensor(0, torch.float32, (N,)).copy_(torch.randn(N, generator=g))
    pseg = conn.call("attach", {"shm": params.name, "size": params.size})["seg"]
    gseg = conn.call("attach", {"shm": grads.name, "size": grads.size})["seg"]
    xseg = conn.call("attach", {"shm": xfer.name, "size": xfer.size})["seg"]
    tid = conn.call("register", {"tensors": [{"name": "w", "shape": [N], "dtype": "float32",
                                              "param": {"seg": pseg, "off": 0, "nbytes": 4 * N}, "hyper": HYPER}]})["ids"][0]
    r = Rig(conn, params, grads, xfer, pseg, gseg, xseg, tid)
    # One real step first, so the state is not all zeros.
    conn.call("step", {"items": [r.step_item(step=1, scalars=torch_scalars(GROUP, 1.0))]})
    yield r
    conn.shutdown()


def env(op: str, body: Any, v: int = 1, rid: int = 1_000_000) -> bytes:
    return msgpack.packb({"v": v, "op": op, "id": rid, "body": body}, use_bin_type=True)


CASES: dict[str, Any] = {
    "malformed msgpack": [b"\xc1\xff\x00garbage"],
    "envelope not a map": [msgpack.packb([1, 2, 3])],
    "empty frame": [b""],
    "two payload frames": [env("stats", {}), env("stats", {})],
    "unsupported version": [env("stats", {}, v=99)],
    "unknown op": [env("format_disk", {})],
    "missing body": [msgpack.packb({"v": 1, "op": "step", "id": 5})],
    "body of wrong type": [env("step", {"items": "lots"})],
    "unknown tensor": lambda r: env("step", {"items": [r.step_item(tensor=424242)]}),
    "unknown segment": lambda r: env("step", {"items": [r.step_item(grad={"seg": 999, "off": 0, "nbytes": 4 * N})]}),
    "wrong gradient size (shape)": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.gseg, "off": 0, "nbytes": 4 * N - 4})]}),
    "offset out of range": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.gseg, "off": 8192 - 100, "nbytes": 4 * N})]}),
    "negative offset": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.gseg, "off": -4, "nbytes": 4 * N})]}),
    "huge offset": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.gseg, "off": 2**62, "nbytes": 4 * N})]}),
    "misaligned offset": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.gseg, "off": 2, "nbytes": 4 * N})]}),
    "gradient is the parameter": lambda r: env("step", {"items": [r.step_item(grad={"seg": r.pseg, "off": 0, "nbytes": 4 * N})]}),
    "duplicate tensor in one step": lambda r: env("step", {"items": [r.step_item(), r.step_item()]}),
    "good item then bad item": lambda r: env("step", {"items": [r.step_item(), r.step_item(tensor=77777)]}),
    "client step count mismatch": lambda r: env("step", {"items": [r.step_item(step=9)]}),
    "amsgrad mismatch": lambda r: env("step", {"items": [r.step_item(scalars={**torch_scalars(GROUP, 2.0), "amsgrad": True})]}),
    "non-finite scalar": lambda r: env("step", {"items": [r.step_item(scalars={**torch_scalars(GROUP, 2.0), "eps": float("nan")})]}),
    "register wrong dtype": lambda r: env("register", {"tensors": [{"name": "x", "shape": [N], "dtype": "float16",
                                                                    "param": {"seg": r.pseg, "off": 0, "nbytes": 2 * N}, "hyper": HYPER}]}),
    "register shape/bytes mismatch": lambda r: env("register", {"tensors": [{"name": "x", "shape": [N, 2], "dtype": "float32",
                                                                             "param": {"seg": r.pseg, "off": 0, "nbytes": 4 * N}, "hyper": HYPER}]}),
    "register absurd shape": lambda r: env("register", {"tensors": [{"name": "x", "shape": [2**40, 2**40], "dtype": "float32",
                                                                     "param": {"seg": r.pseg, "off": 0, "nbytes": 4}, "hyper": HYPER}]}),
    "duplicate registration": lambda r: env("register", {"tensors": [{"name": "w", "shape": [N], "dtype": "float32",
                                                                      "param": {"seg": r.pseg, "off": 0, "nbytes": 4 * N}, "hyper": HYPER}]}),
    "register bad beta": lambda r: env("register", {"tensors": [{"name": "y", "shape": [N], "dtype": "float32",
                                                                 "param": {"seg": r.pseg, "off": 0, "nbytes": 4 * N},
                                                                 "hyper": {**HYPER, "beta1": 1.5}}]}),
    "attach path traversal": [env("attach", {"shm": "../../etc/passwd", "size": 4096})],
    "attach foreign name": [env("attach", {"shm": "not-sonar", "size": 4096})],
    "attach missing segment": [env("attach", {"shm": "sonar-does-not-exist", "size": 4096})],
    "import of wrong size": lambda r: env("import", {"tensor": r.tid, "step": 5,
                                                      "exp_avg": {"seg": r.xseg, "off": 0, "nbytes": 4 * N},
                                                      "exp_avg_sq": {"seg": r.xseg, "off": 8192, "nbytes": 8},
                                                      "max_exp_avg_sq": {"seg": 0, "off": 0, "nbytes": 0}}),
    "detach a segment holding a tensor": lambda r: env("detach", {"seg": r.pseg}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_changes_nothing(rig: Rig, case: str) -> None:
    before = (rig.param_bytes(), rig.state())
    spec = CASES[case]
    frames = spec(rig) if callable(spec) else spec
    rig.conn.send_raw(frames if isinstance(frames, list) else [frames])
    rep = rig.conn.recv_raw(timeout=10)
    assert rep["ok"] is False, rep
    assert isinstance(rep["error"], str) and len(rep["error"]) > 10
    # The server keeps serving and nothing changed.
    assert rig.conn.call("stats", {})["tensors"] == 1
    assert (rig.param_bytes(), rig.state()) == before, f"{case} changed parameter or state bytes"


def test_valid_step_still_works_after_bad_input(rig: Rig) -> None:
    before = rig.param_bytes()
    _, _, step = rig.state()
    rig.conn.call("step", {"items": [rig.step_item(step=step + 1, scalars=torch_scalars(GROUP, float(step + 1)))]})
    assert rig.param_bytes() != before
    assert rig.state()[2] == step + 1


def test_error_reply_names_the_problem(rig: Rig) -> None:
    with pytest.raises(SonarError, match="unsupported protocol version|unknown tensor"):
        rig.conn.call("step", {"items": [rig.step_item(tensor=31337)]})
    rig.conn.send_raw([env("stats", {}, v=7)])
    rep = rig.conn.recv_raw(timeout=10)
    assert "version 7" in rep["error"] and "speaks 1" in rep["error"]
