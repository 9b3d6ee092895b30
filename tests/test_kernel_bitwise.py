"""AdamW kernel bitwise tests: sonard's updates vs torch.optim.AdamW on CPU.

Every tensor is an "expert" here, so every update runs in the Go engine; the reference
is torch.optim.AdamW with default options (the single-tensor path) on clones.
"""

from __future__ import annotations

import functools
import os
from typing import Any, cast

import pytest
import torch

import sonar_moe

SIZES = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 511, 513, 1000, 4097,
         32767, 32768, 32769, 65537, 100003, 1_000_003]

HYPERS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_decay": {"weight_decay": 0.0},
    "amsgrad": {"amsgrad": True, "lr": 3e-3},
    "maximize": {"maximize": True, "weight_decay": 0.1},
    "odd_betas": {"betas": (0.3, 0.95), "eps": 1e-6, "lr": 0.05, "weight_decay": 0.5},  # lerp weight >= 0.5
    "big_eps_small_lr": {"betas": (0.8, 0.9), "eps": 1e-3, "lr": 1e-5},
}
STEPS = 6


def _params(dtype: torch.dtype, seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"t{n}", torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))) for n in SIZES]


def _grads(params: list[tuple[str, torch.nn.Parameter]], g: torch.Generator, step: int) -> list[torch.Tensor]:
    # Mixed magnitudes so exp_avg_sq spans many binades; never zeros.
    out = []
    for _, p in params:
        scale = torch.exp2(torch.randint(-12, 4, p.shape, generator=g).float())
        out.append((torch.randn(p.shape, generator=g) * scale).to(p.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_kernel_matches_torch(dtype: torch.dtype, hyper: str) -> None:
    _train_and_compare(dtype, hyper)


@functools.cache
def _widest_isa() -> str:
    """The instruction set a private sonard's kernels run at without SONAR_ISA: the CPU's widest
    (asked once; call it with SONAR_ISA unset)."""
    assert "SONAR_ISA" not in os.environ
    p = torch.nn.Parameter(torch.randn(8))
    with sonar_moe.SonarAdamW([("experts.w", p)], expert_params=lambda n, q: True) as opt:
        return str(opt.stats()["server_isa"])


ISAS = ["go", "avx2", "avx512", "avx512bf16", "avx512vbmi"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_matches_torch(dtype: torch.dtype, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SONAR_ISA caps the server's kernels at a narrower level (never above the CPU's): each
    level this CPU has is bitwise torch's, and the server says which it runs."""
    monkeypatch.delenv("SONAR_ISA", raising=False)
    widest = _widest_isa()
    monkeypatch.setenv("SONAR_ISA", isa)
    want = ISAS[min(ISAS.index(isa), ISAS.index(widest))]
    for hyper in ("default", "maximize", "odd_betas"):
        assert _train_and_compare(dtype, hyper) == want


def _train_and_compare(dtype: torch.dtype, hyper: str) -> str:
    """STEPS steps of HYPERS[hyper] through SonarAdamW and torch.optim.AdamW, compared after each
    step, then the state; returns the server's kernel instruction set."""
    kw = HYPERS[hyper]
    seed = hash((str(dtype), hyper)) & 0xFFFF
    ref = _params(dtype, seed)
    mine = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ref]
    ropt = torch.optim.AdamW(ref, **kw)  # named, as SonarAdamW gets them: both record param_names
    gen = torch.Generator().manual_seed(seed + 1)
    with sonar_moe.SonarAdamW(mine, expert_params=lambda n, p: True, **kw) as opt:
        for step in range(STEPS):
            grads = _grads(ref, gen, step)
            for (_, p), g in zip(ref, grads):
                p.grad = g.clone()
            ropt.step()
            ropt.zero_grad()
            # Through autograd, so the post-accumulate-grad hooks fire: d/dp sum(p*g) = g exactly.
            loss = cast(torch.Tensor, sum((p * g).sum() for (_, p), g in zip(mine, grads)))  # not empty: a Tensor
            loss.backward()
            opt.step()
            opt.zero_grad()
            for (name, a), (_, b) in zip(ref, mine):
                assert b.grad is None
                if not torch.equal(a, b):
                    diff = (a.float() - b.float()).abs()
                    pytest.fail(f"{hyper}/{dtype} step {step + 1}: {name} differs at {int((diff > 0).sum())} "
                                f"elements, first at {int(diff.flatten().nonzero()[0])}")
        sd = opt.state_dict()
        isa = opt.stats()["server_isa"]
    # The optimizer state matches torch's too, in torch's format.
    rsd = ropt.state_dict()
    assert sd["param_groups"][0].keys() == rsd["param_groups"][0].keys()
    for i in range(len(SIZES)):
        assert sd["state"][i].keys() == rsd["state"][i].keys()
        for k, v in rsd["state"][i].items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    return isa


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_result(threads: int) -> None:
    """torch splits work across threads; the update must not depend on how."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        test_kernel_matches_torch(torch.float32, "default")
    finally:
        torch.set_num_threads(old)


FOREACH_SIZES = [1, 7, 17, 33, 513, 4097, 32769, 70001]
FOREACH_HYPERS: dict[str, dict[str, Any]] = {
    "beta2_099": {"lr": 3e-3, "weight_decay": 0.05, "betas": (0.85, 0.99)},
    "strong_decay_amsgrad": {"lr": 0.05, "weight_decay": 0.5, "betas": (0.3, 0.9), "amsgrad": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("foreach", [None, False, True], ids=["foreach_none", "foreach_false", "foreach_true"])
@pytest.mark.parametrize("hyper", list(FOREACH_HYPERS))
def test_foreach_flag_on_cpu_matches_the_torch_path_it_selects(dtype: torch.dtype, foreach: bool | None,
                                                               hyper: str) -> None:
    """On CPU, torch.optim.AdamW(foreach=None/False) runs _single_tensor_adam and foreach=True
    _multi_tensor_adam; SonarAdamW with the same flag equals each of them. The two differ in
    bfloat16 where the weight decay factor or beta2 is not representable in bfloat16 (foreach's
    _foreach_mul_ rounds its scalar to bfloat16 on CPU; beta2=0.999 and small lr*weight_decay
    happen to give the same result either way)."""
    kw = {**FOREACH_HYPERS[hyper], "foreach": foreach}
    g = torch.Generator().manual_seed(11 + (foreach is True))
    ref = [(f"t{n}", torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))) for n in FOREACH_SIZES]
    mine = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ref]
    ropt = torch.optim.AdamW(ref, **kw)
    with sonar_moe.SonarAdamW(mine, expert_params=lambda n, p: True, **kw) as opt:
        for step in range(5):
            grads = _grads(ref, g, step)
            for (_, p), gr in zip(ref, grads):
                p.grad = gr.clone()
            ropt.step()
            ropt.zero_grad()
            cast(torch.Tensor, sum((p * gr).sum() for (_, p), gr in zip(mine, grads))).backward()  # not empty: a Tensor
            opt.step()
            opt.zero_grad()
            for (name, a), (_, b) in zip(ref, mine):
                assert torch.equal(a, b), f"foreach={foreach} {dtype} step {step + 1}: {name} differs"
