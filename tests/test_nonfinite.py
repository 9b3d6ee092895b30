"""Non-finite gradients: propagate as torch does (default), or skip the tensor's update."""

from __future__ import annotations

from typing import cast

import pytest
import torch

import sonar_moe


def _params(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [("experts.a", torch.nn.Parameter(torch.randn(4, 8, 16, generator=g))),
            ("experts.b", torch.nn.Parameter(torch.randn(4, 16, 8, generator=g))),
            ("dense", torch.nn.Parameter(torch.randn(33, generator=g)))]


def _grads(step: int, poison: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g), torch.randn(33, generator=g)]
    if poison:
        out[0][1, 2, 3] = float("nan")
        out[2][5] = float("inf")
    return out


def _backward(params: list[tuple[str, torch.nn.Parameter]], grads: list[torch.Tensor]) -> None:
    cast(torch.Tensor, sum((p * g).sum() for (_, p), g in zip(params, grads))).backward()  # not empty: a Tensor


def test_propagate_matches_torch() -> None:
    ref, mine = _params(0), _params(0)
    ropt = torch.optim.AdamW([p for _, p in ref])
    with sonar_moe.SonarAdamW(mine) as opt:
        for step in range(3):
            grads = _grads(step, poison=step == 1)
            for (_, p), g in zip(ref, grads):
                p.grad = g.clone()
            ropt.step()
            ropt.zero_grad()
            _backward(mine, grads)
            opt.step()
            opt.zero_grad()
    for (n, a), (_, b) in zip(ref, mine):
        assert torch.equal(a.isnan(), b.isnan()), n
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), n
    assert mine[0][1].isnan().any()  # the NaN did propagate, as in torch


def test_skip_leaves_poisoned_tensors_untouched() -> None:
    mine = _params(0)
    with sonar_moe.SonarAdamW(mine, nonfinite="skip") as opt:
        _backward(mine, _grads(0, poison=False))
        opt.step()
        opt.zero_grad()
        before = [p.detach().clone() for _, p in mine]
        _backward(mine, _grads(1, poison=True))
        opt.step()
        opt.zero_grad()
        after = [p.detach().clone() for _, p in mine]
        assert torch.equal(before[0], after[0])  # poisoned expert tensor: skipped
        assert not torch.equal(before[1], after[1])  # clean expert tensor: updated
        assert torch.equal(before[2], after[2])  # dense step skipped (an Inf)
        assert opt.stats()["skipped_nonfinite"] == 2
        sd = opt.state_dict()
        assert sd["state"][0]["step"].item() == 1 and sd["state"][1]["step"].item() == 2
        assert all(torch.isfinite(p).all() for _, p in mine)
    with pytest.raises(ValueError, match="nonfinite"):
        sonar_moe.SonarAdamW(_params(1), nonfinite="ignore")
