"""sonard's fused updates vs torch.optim.AdamW(fused=True) on CPU, bit for bit.

Every tensor is an expert here, so every update runs in the Go engine's fused arithmetic
(optimizer/fused.go, the evaluation order of docs/fused-adamw-cpu.md); the reference is
torch's fused CPU kernel on clones. Sizes cover odd tails of the 8- and 16-lane vector loop.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

import sonar_moe

SIZES = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 127, 513, 4097, 32769, 65537, 100003]

HYPERS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_decay": {"weight_decay": 0.0},
    "amsgrad": {"amsgrad": True, "lr": 3e-3},
    "maximize": {"maximize": True, "weight_decay": 0.1},
    "odd_betas": {"betas": (0.3, 0.95), "eps": 1e-6, "lr": 0.05, "weight_decay": 0.5},  # the other lerp branch
    "big_eps_small_lr": {"betas": (0.8, 0.9), "eps": 1e-3, "lr": 1e-5},
}
STEPS = 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_fused_matches_torch_fused(dtype: torch.dtype, hyper: str) -> None:
    kw = {**HYPERS[hyper], "fused": True}
    seed = hash((str(dtype), hyper)) & 0xFFFF
    g = torch.Generator().manual_seed(seed)
    ref = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]
    mine = [(f"t{n}", torch.nn.Parameter(p.detach().clone())) for n, p in zip(SIZES, ref)]
    ropt = torch.optim.AdamW(ref, **kw)
    with sonar_moe.SonarAdamW(mine, expert_params=lambda n, p: True, **kw) as opt:
        for step in range(STEPS):
            grads = [(torch.randn(p.shape, generator=g) * torch.exp2(torch.randint(-12, 4, p.shape, generator=g).float()))
                     .to(dtype) for p in ref]
            for p, gr in zip(ref, grads):
                p.grad = gr.clone()
            ropt.step()
            ropt.zero_grad()
            loss = cast(torch.Tensor, sum((p * gr).sum() for (_, p), gr in zip(mine, grads)))  # not empty: a Tensor
            loss.backward()  # d/dp sum(p*g) = g exactly: the hooks hand g over
            opt.step()
            opt.zero_grad()
            for n, a, (_, b) in zip(SIZES, ref, mine):
                assert torch.equal(a, b), f"{hyper}/{dtype} step {step + 1}: size {n} differs at {int((a != b).sum())}"
        sd = opt.state_dict()
    rsd = ropt.state_dict()
    for i in range(len(SIZES)):
        for k, v in rsd["state"][i].items():
            assert torch.equal(v, sd["state"][i][k]), f"state {k} of size {SIZES[i]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_nonfinite_bit_patterns(dtype: torch.dtype) -> None:
    """NaN and infinity in gradients, in the vector loop and in the scalar tail: the stored bit
    patterns equal torch's (its vectorized bfloat16 conversion makes a NaN 0xFFFF, the scalar
    one 0x7FC0)."""
    g = torch.Generator().manual_seed(11)
    sizes = [37, 1029, 70001]
    ref = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]
    mine = [(f"t{n}", torch.nn.Parameter(p.detach().clone())) for n, p in zip(sizes, ref)]
    ropt = torch.optim.AdamW(ref, fused=True)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    with sonar_moe.SonarAdamW(mine, expert_params=lambda n, p: True, fused=True) as opt:
        for step in range(3):
            grads = []
            for n in sizes:
                gr = torch.randn(n, generator=g)
                idx = torch.randint(0, n, (6,), generator=g)
                gr[idx[:2]] = float("nan")
                gr[idx[2:4]] = float("inf")
                gr[idx[4:]] = -float("inf")
                gr[-1] = float("nan")  # in the tail of every lane count
                grads.append(gr.to(dtype))
            for p, (_, q), gr in zip(ref, mine, grads):
                p.grad, q.grad = gr.clone(), gr.clone()  # hand-set gradients: step() sends them
            ropt.step()
            opt.step()
            for n, a, (_, b) in zip(sizes, ref, mine):
                assert torch.equal(a.detach().view(bits), b.detach().view(bits)), f"step {step + 1} size {n}"
