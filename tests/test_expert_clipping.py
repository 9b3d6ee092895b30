"""SonarAdamW(expert_clipping=...): global-norm clipping of the expert gradients with a factor
fixed before each step, applied by a real sonard, against torch.optim.AdamW on the scaled
gradients, bit for bit.

Reference of one step t: every expert gradient times the factor the optimizer says it used
(``last_expert_grad_scale``, a float32 tensor multiplied in as ``grad.mul_`` does), the dense
gradients clipped by the step's global norm (``clip_grads_with_norm_(dense, c, G_t)``), then
``torch.optim.AdamW`` over all parameters. Independently of Sonar, the test checks that G_t is
the norm of all reference gradients and that the factors follow the mode's formula.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import sonar_moe
import tiny_moe as tm

STEPS = 5
CLIP = 0.05  # small: the factor is below 1 on most steps
CORPUS = tm.load_corpus(50_000)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on busy shared cores two OpenMP threads stall a tiny model's steps."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def data(seed: int, batch: int = 4, seq: int = 16) -> Iterator[torch.Tensor]:
    return tm.batches(CORPUS, batch, seq, torch.Generator().manual_seed(seed))


def assert_same(ref: torch.nn.Module, mine: torch.nn.Module, where: str) -> None:
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        assert torch.equal(a, b), f"{where}: {n} differs (max |diff| {(a.float() - b.float()).abs().max().item():.3e})"


def grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient, which the backward just before computed."""
    assert p.grad is not None
    return p.grad


def coef(c: float, norm: float) -> float:
    return float(torch.clamp(c / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0))


# Each mode in both dtypes, with and without gradient accumulation (not all combinations: CI time).
CASES = [("prev_global", torch.float32, 1), ("prev_global", torch.bfloat16, 2),
         ("running", torch.float32, 2), ("running", torch.bfloat16, 1)]


@pytest.mark.parametrize("mode,dtype,accum", CASES,
                         ids=[f"{m}-{'fp32' if d == torch.float32 else 'bf16'}-accum{k}" for m, d, k in CASES])
def test_expert_clipping_matches_torch_on_scaled_grads(mode: str, dtype: torch.dtype, accum: int) -> None:
    cfg = tm.MoEConfig(dtype=dtype, num_layers=2, hidden=32, intermediate=48, num_experts=4)
    ref, mine = tm.build(cfg, 4), tm.build(cfg, 4)
    experts = set(tm.expert_param_names(ref))
    ref_experts = [p for n, p in ref.named_parameters() if n in experts]
    ref_dense = [p for n, p in ref.named_parameters() if n not in experts]
    kw: dict[str, Any] = dict(lr=3e-3, weight_decay=0.05)
    ropt = torch.optim.AdamW(ref.parameters(), **kw)
    ema, scales, want_next = 0.0, [], 1.0
    with sonar_moe.SonarAdamW(mine, max_grad_norm=CLIP, expert_clipping=mode, grad_accumulation_steps=accum,
                              **kw) as opt:
        assert opt.next_expert_grad_scale == 1.0  # step 1: no estimate yet
        for step, x in zip(range(1, STEPS + 1), data(3 + accum)):
            for micro in x.chunk(accum):
                loss, _ = mine(micro, labels=micro)
                loss.backward()
                rloss, _ = ref(micro, labels=micro)
                rloss.backward()
            opt.step()
            opt.zero_grad()
            # What the optimizer used, and the norm it measured, against the reference's gradients.
            scale, g = opt.last_expert_grad_scale, opt.last_global_grad_norm
            assert scale == want_next, f"step {step}: factor {scale}, the mode's formula gives {want_next}"
            exact = math.sqrt(sum(float(grad(p).double().pow(2).sum()) for p in ref.parameters()))
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: torch's dense norm is a bf16 value
            assert g is not None, f"step {step}: no global norm"
            assert g == pytest.approx(exact, rel=tol), f"step {step}: global norm {g}, reference {exact}"
            for p in ref_experts:
                grad(p).mul_(torch.tensor(scale, dtype=torch.float32))
            torch.nn.utils.clip_grads_with_norm_(ref_dense, CLIP, torch.tensor(g, dtype=torch.float32))
            ropt.step()
            ropt.zero_grad()
            assert_same(ref, mine, f"step {step}")
            scales.append(scale)
            if mode == "prev_global":
                want_next = coef(CLIP, g)
            else:
                ema = 0.9 * ema + 0.1 * g
                want_next = coef(CLIP, ema / (1 - 0.9 ** step))
            assert opt.next_expert_grad_scale == want_next
        assert opt.stats()["server"]["errors"] == 0
    assert scales[0] == 1.0 and sum(1 for s in scales if s < 1.0) >= STEPS - 2, scales


def test_expert_clipping_state_dict_round_trip() -> None:
    """The factor of the next step travels with state_dict; a new optimizer continues bit for bit."""
    cfg = tm.MoEConfig(num_layers=2, hidden=32, intermediate=48, num_experts=4)
    a, b = tm.build(cfg, 8), tm.build(cfg, 8)
    batches = list(zip(range(4), data(21)))
    with sonar_moe.SonarAdamW(a, max_grad_norm=CLIP, expert_clipping="running") as opt:
        for i, x in batches:
            loss, _ = a(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                sd = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live dense state
                b.load_state_dict(a.state_dict())
        assert "sonar_expert_clipping" in sd
    with sonar_moe.SonarAdamW(b, max_grad_norm=CLIP, expert_clipping="running") as opt2:
        opt2.load_state_dict(sd)
        assert opt2.next_expert_grad_scale == sd["sonar_expert_clipping"]["scale"]
        for _i, x in batches[2:]:
            loss, _ = b(x, labels=x)
            loss.backward()
            opt2.step()
            opt2.zero_grad()
    assert_same(a, b, "after resume")
    # torch.optim.AdamW loads it too (the extra key is ignored).
    torch.optim.AdamW(tm.build(cfg, 8).parameters()).load_state_dict(sd)


def test_refused_load_leaves_the_clipping_state() -> None:
    """A state_dict refused by torch's own checks (another number of groups) changes nothing,
    the clipping estimate and next factor neither (red team: the factor became the refused
    dict's, and training drifted from a twin that never tried the load)."""
    cfg = tm.MoEConfig(num_layers=2, hidden=32, intermediate=48, num_experts=4)
    m = tm.build(cfg, 8)
    with sonar_moe.SonarAdamW(m, max_grad_norm=CLIP, expert_clipping="running") as opt:
        for _i, x in zip(range(3), data(22)):
            loss, _ = m(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        before = copy.deepcopy(opt.state_dict())
        bad = copy.deepcopy(before)
        bad["param_groups"].append(dict(bad["param_groups"][0], params=[]))
        bad["sonar_expert_clipping"].update(scale=1.0, ema=42.0, steps=77)
        with pytest.raises(ValueError, match="parameter groups"):
            opt.load_state_dict(bad)
        assert opt.state_dict()["sonar_expert_clipping"] == before["sonar_expert_clipping"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(expert_clipping="global", max_grad_norm=1.0), "expert_clipping must be"),
    (dict(expert_clipping="prev_global"), "set max_grad_norm"),
    (dict(expert_clipping="running", max_grad_norm=1.0, max_expert_grad_norm=1.0), "choose one"),
])
def test_expert_clipping_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sonar_moe.SonarAdamW(tm.build(tm.MoEConfig(num_layers=1), 0), **kwargs)
