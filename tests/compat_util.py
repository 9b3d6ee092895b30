"""Shared harness of the torch-compatibility tests (tests/test_torch_compat.py,
tests/test_lr_schedulers_compat.py): a small model with batched 3-D expert tensors, random
data, and bitwise comparisons against ``torch.optim.AdamW``.

The comparison harness checks itself: with ``SONAR_COMPAT_REFERENCE=torch`` in the
environment, ``SonarAdamW`` below is ``torch.optim.AdamW`` behind SonarAdamW's constructor
(``TorchStandIn``), so every bitwise comparison must pass (torch against torch); the tests
of SonarAdamW's own errors are skipped in that mode (``sonar_only``). Run it as

    SONAR_COMPAT_REFERENCE=torch .venv/bin/python -m pytest -q tests/test_torch_compat.py \
        tests/test_lr_schedulers_compat.py
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sonar_moe

REFERENCE = os.environ.get("SONAR_COMPAT_REFERENCE", "") == "torch"

# Small sizes: 2 cores, one private sonard per optimizer.
IN, HIDDEN, INTER, EXPERTS, OUT, BATCH = 12, 16, 24, 4, 8, 8

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]

# The constructor keywords of SonarAdamW that torch.optim.AdamW does not have.
_SONAR_ONLY_KW = ("max_grad_norm", "expert_params", "server", "grad_accumulation_steps", "model", "grad_scaler",
                  "max_expert_grad_norm", "split_experts", "nonfinite", "timeout", "ring_layers", "namespace")


class TorchStandIn(torch.optim.AdamW):
    """torch.optim.AdamW behind SonarAdamW's constructor: what the harness compares to itself.

    Accepts SonarAdamW's call forms (a module, a mix of named and bare parameters) and ignores
    its own keywords (they change nothing in torch's arithmetic: max_grad_norm stays None in
    these tests, a GradScaler works through unscale_ with torch)."""

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *args: Any, **kw: Any) -> None:
        for k in _SONAR_ONLY_KW:
            kw.pop(k, None)
        if isinstance(params, nn.Module):
            params = params.parameters()
        params = list(params)
        if params and not isinstance(params[0], dict):
            named = [isinstance(p, tuple) for p in params]
            if any(named) and not all(named):  # torch refuses a mix: keep the tensors
                params = [p[1] if isinstance(p, tuple) else p for p in params]
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)

    def close(self) -> None:
        pass

    def __enter__(self) -> TorchStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SonarAdamW: Any = TorchStandIn if REFERENCE else sonar_moe.SonarAdamW


def sonar_only() -> None:
    """Skip in the torch-vs-torch harness check: the test is about SonarAdamW's own errors."""
    if REFERENCE:
        pytest.skip("tests SonarAdamW's own behaviour; not applicable to the torch stand-in")


# ------------------------------------------------------------------ the model
class BatchedExperts(nn.Module):
    """All experts of a layer in two 3-D tensors, named as HF transformers v5 OLMoE names them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(EXPERTS, 2 * INTER, HIDDEN))
        self.down_proj = nn.Parameter(torch.empty(EXPERTS, HIDDEN, INTER))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H] -> every expert's output [B, E, H]."""
        gate, up = torch.einsum("bh,eih->bei", x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.einsum("bei,ehi->beh", F.silu(gate) * up, self.down_proj)


class MoEMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = BatchedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x).float(), dim=-1).to(x.dtype)  # soft routing: every expert gets a gradient
        return (probs.unsqueeze(-1) * self.experts(x)).sum(1)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = MoEMLP()


class TinyExpertModel(nn.Module):
    """Dense Linear/LayerNorm/router parameters around ``layers.<i>.mlp.experts.gate_up_proj``
    [E, 2I, H] and ``layers.<i>.mlp.experts.down_proj`` [E, H, I]."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, skip: Iterable[int] = ()) -> torch.Tensor:
        """Layers in ``skip`` are left out of the forward (their parameters get no gradient)."""
        skip = set(skip)
        h = self.embed(x)
        for i, layer in enumerate(cast("Iterable[Layer]", self.layers)):  # Layer()s, built above
            if i not in skip:
                h = h + layer.mlp(layer.norm(h))
        return self.head(self.norm(h))


def make_model(dtype: torch.dtype = torch.float32, num_layers: int = 2, seed: int = 0) -> TinyExpertModel:
    """Every parameter random (LayerNorm weights around 1), from a private generator."""
    model = TinyExpertModel(num_layers)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def clone_model(model: TinyExpertModel) -> TinyExpertModel:
    """A model of the same shape with equal parameters (values and requires_grad), built fresh:
    nothing of the original (hooks, shared storage) comes along."""
    first = next(model.parameters())
    new = TinyExpertModel(len(model.layers)).to(first.dtype)
    with torch.no_grad():
        for (n, p), (m, q) in zip(model.named_parameters(), new.named_parameters()):
            assert n == m
            q.copy_(p)
            q.requires_grad_(p.requires_grad)
    return new


def expert_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() >= 3]


def dense_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() < 3]


def batch(seed: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10_007 + step)
    x = torch.randn(BATCH, IN, generator=g).to(dtype)
    y = torch.randn(BATCH, OUT, generator=g).to(dtype)
    return x, y


def batches(seed: int, dtype: torch.dtype = torch.float32) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    step = 0
    while True:
        yield batch(seed, step, dtype)
        step += 1


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, skip: Iterable[int] = ()) -> torch.Tensor:
    return (model(x, skip=skip).float() - y.float()).pow(2).mean()


def fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, skip: Iterable[int] = (),
            scale: float = 1.0) -> torch.Tensor:
    loss = loss_of(model, x, y, skip)
    (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               skip: Iterable[int] = ()) -> torch.Tensor:
    """One ordinary step: zero_grad, forward, backward, step."""
    opt.zero_grad()
    loss = fwd_bwd(model, x, y, skip)
    opt.step()
    return loss


# ---------------------------------------------------------------- comparisons
def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    return f"max |diff| {(a.double() - b.double()).abs().max().item():.3e}"


def assert_models_equal(ref: nn.Module, mine: nn.Module, where: str) -> None:
    """Every parameter bit for bit (torch.equal), by name."""
    rp, mp = dict(ref.named_parameters()), dict(mine.named_parameters())
    assert rp.keys() == mp.keys(), where
    for n, a in rp.items():
        b = mp[n]
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {n} differs ({_diff(a, b)})"


def assert_models_differ(before: dict[str, torch.Tensor], model: nn.Module, names: Iterable[str], where: str) -> None:
    """The named parameters changed since ``before`` (the optimizer really trained them)."""
    cur = dict(model.named_parameters())
    for n in names:
        assert not torch.equal(before[n], cur[n]), f"{where}: {n} was not updated"


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_snapshot_equal(snap: dict[str, torch.Tensor], model: nn.Module, where: str,
                          names: Iterable[str] | None = None) -> None:
    cur = dict(model.named_parameters())
    for n in (snap if names is None else names):
        assert torch.equal(snap[n], cur[n]), f"{where}: {n} changed ({_diff(snap[n], cur[n])})"


def value_equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(value_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_state_dicts_equal(mine: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    """``mine`` holds what torch's ``ref`` holds: the same state entries (keys, dtypes, bits) and
    param groups with every key torch has ("param_names" aside, as torch's own
    test_state_dict_deterministic does); extra keys in ``mine``'s groups are allowed."""
    assert set(mine["state"]) == set(ref["state"]), f"{where}: state indices {sorted(mine['state'])} vs torch {sorted(ref['state'])}"
    for i, rs in ref["state"].items():
        ms = mine["state"][i]
        assert set(ms) == set(rs), f"{where}: state[{i}] keys {sorted(ms)} vs torch {sorted(rs)}"
        for k, v in rs.items():
            assert value_equal(ms[k], v), f"{where}: state[{i}][{k!r}] differs: {ms[k]!r:.80} vs torch {v!r:.80}"
    assert len(mine["param_groups"]) == len(ref["param_groups"]), f"{where}: number of param groups"
    for gi, (mg, rg) in enumerate(zip(mine["param_groups"], ref["param_groups"])):
        for k, v in rg.items():
            if k == "param_names":
                continue
            assert k in mg, f"{where}: param_groups[{gi}] lacks {k!r}"
            assert value_equal(mg[k], v), f"{where}: param_groups[{gi}][{k!r}] = {mg[k]!r} vs torch {v!r}"


def same_params(src: nn.Module, dst: nn.Module, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``dst`` that have the names ``params`` have in ``src``."""
    name_of = {id(p): n for n, p in src.named_parameters()}
    d = dict(dst.named_parameters())
    return [d[name_of[id(p)]] for p in params]


def map_groups(src: nn.Module, dst: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same param groups over ``dst``'s parameters (hyper-parameters copied, tensors cloned)."""
    out = []
    for g in groups:
        h = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
        h["params"] = same_params(src, dst, g["params"])
        out.append(h)
    return out
