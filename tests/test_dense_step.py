"""SonarAdamW's dense step against torch.optim.AdamW, bit for bit, on the foreach path it takes
for float32 on CPU (``sonar_moe.optimizer.dense_foreach``) and the single-tensor path it keeps
elsewhere. No server: a model without experts trains as AdamW in this process."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import sonar_moe
from sonar_moe.optimizer import dense_foreach

HYPERS: dict[str, dict[str, Any]] = {
    "adamw": dict(lr=3e-3, weight_decay=0.05),
    "no-decay": dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.0, eps=1e-6),
    "amsgrad": dict(lr=2e-3, weight_decay=0.1, amsgrad=True),
    "maximize": dict(lr=1e-3, weight_decay=0.01, maximize=True),
    "odd-betas": dict(lr=7e-3, betas=(0.3, 0.77), weight_decay=0.5, eps=1e-3),
}


def model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # Odd sizes: every tensor has a tail past any vector width.
    m = nn.Sequential(nn.Linear(37, 53), nn.LayerNorm(53), nn.GELU(), nn.Linear(53, 29), nn.Tanh(),
                      nn.Linear(29, 5, bias=False))
    return m.to(dtype)


def sonar(m: nn.Module, **kw: Any) -> sonar_moe.SonarAdamW:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sonar_moe.NoExpertsWarning)
        return sonar_moe.SonarAdamW(m, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("hyper", list(HYPERS))
def test_dense_step_matches_torch_adamw(hyper: str, clip: float | None, dtype: torch.dtype) -> None:
    kw = HYPERS[hyper]
    ref = model(dtype, 3)
    mine = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), **kw)
    gen = torch.Generator().manual_seed(17)
    with sonar(mine, max_grad_norm=clip, **kw) as opt:
        group = opt.param_groups[0]
        # The test covers the path it means to: foreach for float32, torch's own flag otherwise.
        steps = [torch.tensor(0.0) for _ in mine.parameters()]
        assert dense_foreach(group, list(mine.parameters()), steps) is (True if dtype == torch.float32 else None)
        for step in range(6):
            x = torch.randn(8, 37, generator=gen).to(dtype)
            for m, o in ((ref, ropt), (mine, opt)):
                m(x).float().pow(2).mean().backward()
                if clip is not None and o is ropt:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                o.step()
                o.zero_grad()
            for (n, a), b in zip(ref.named_parameters(), mine.parameters(), strict=True):
                assert torch.equal(a, b), f"{hyper} {dtype} step {step + 1}: {n} differs"
            for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
                for key in ropt.state[a]:
                    assert torch.equal(ropt.state[a][key], opt.state[b][key]), f"step {step + 1}: state {key} differs"


def group_of(**over: Any) -> dict[str, Any]:
    g: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8, foreach=None, fused=None,
                             capturable=False, differentiable=False)
    g.update(over)
    return g


F32 = [torch.zeros(3), torch.zeros(2, 2)]
INT64_STEPS = [torch.zeros(3), torch.zeros(2, 2)]  # F32, with int64 step tensors


@pytest.mark.parametrize("group,params,want", [
    (group_of(), F32, True),
    (group_of(foreach=False), F32, False),  # the user's own choice stands
    (group_of(foreach=True), F32, True),
    (group_of(fused=True), F32, None),
    (group_of(capturable=True), F32, None),
    (group_of(differentiable=True), F32, None),
    (group_of(lr=torch.tensor(1e-3)), F32, None),
    (group_of(betas=(torch.tensor(0.9), 0.999)), F32, None),
    (group_of(weight_decay=torch.tensor(0.01)), F32, None),
    (group_of(eps=torch.tensor(1e-8)), F32, None),
    (group_of(), [torch.zeros(3, dtype=torch.bfloat16)], None),
    (group_of(), [torch.zeros(3), torch.zeros(3, dtype=torch.float16)], None),
    (group_of(), [torch.zeros(3, dtype=torch.float64)], None),
    (group_of(), [torch.zeros(3, dtype=torch.complex64)], None),
    (group_of(), [], None),
    (group_of(), INT64_STEPS, None),  # a loaded state's int64 steps: foreach refuses them
], ids=["default", "foreach-false", "foreach-true", "fused", "capturable", "differentiable", "tensor-lr",
        "tensor-beta", "tensor-decay", "tensor-eps", "bf16", "mixed-fp16", "fp64", "complex", "empty", "int64-step"])
def test_dense_foreach_rule(group: dict[str, Any], params: list[torch.Tensor], want: bool | None) -> None:
    steps = [torch.tensor(3, dtype=torch.int64) if params is INT64_STEPS else torch.tensor(3.0) for _ in params]
    assert dense_foreach(group, params, steps) is want


def test_int64_steps_of_a_loaded_state_train_as_torch() -> None:
    """torch keeps a loaded state's int64 ``step`` tensors and its single-tensor path trains on;
    the foreach path Sonar takes for float32 refused them ("same dtype"), after the expert
    updates of the step (red team round 4)."""
    ref = model(torch.float32, 5)
    mine = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    with sonar(mine, lr=1e-2) as opt:
        for step in range(4):
            x = torch.randn(8, 37, generator=gen)
            for m, o in ((ref, ropt), (mine, opt)):
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
            if step == 1:
                sd = ropt.state_dict()
                for st in sd["state"].values():
                    st["step"] = st["step"].to(torch.int64)
                ropt.load_state_dict(copy.deepcopy(sd))  # load_state_dict keeps the dict's tensors
                opt.load_state_dict(copy.deepcopy(sd))
        for (n, a), b in zip(ref.named_parameters(), mine.parameters(), strict=True):
            assert torch.equal(a, b), f"{n} differs"
