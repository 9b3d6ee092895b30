"""LR schedulers drive SonarAdamW exactly as they drive torch.optim.AdamW (issue 13).

Adapted from PyTorch's ``test/optim/test_lrscheduler.py`` (``TestLRScheduler``): its
optimizer has two param groups, one with a tensor lr (``setUp``); per-group lambdas
(``test_lambda_lr``), ``test_step_lr``, OneCycleLR and CyclicLR cycling Adam's beta1
(``test_cycle_lr_with_adam``, ``test_onecycle_lr_cosine_annealing``),
``test_CosineAnnealingWarmRestarts_lr1``, ``test_reduce_lr_on_plateau1``,
``test_sequential_lr1`` and ``test_chained_lr1``, and ``get_last_lr`` (``test_get_last_lr_*``).
Torch checks the LR values a scheduler produces; here the reference is torch.optim.AdamW
driven by the same scheduler: after every step the parameters are bitwise equal (the LR and
betas a scheduler writes into ``param_groups`` reach the expert updates on the server) and
``get_last_lr()`` is equal. Our own code; small model with batched 3-D expert tensors
(tests/compat_util.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as S

from compat_util import SonarAdamW, assert_models_equal, batch, clone_model, make_model, train_step, value_equal

STEPS = 6
HP: dict[str, Any] = dict(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.05)


def two_groups(model: torch.nn.Module, tensor_lr: bool = False) -> list[dict[str, Any]]:
    """Layer 0's expert tensors and the embedding in one group, everything else (layer 1's
    expert tensors included) in the other, with its own lr (a tensor with tensor_lr)."""
    n = dict(model.named_parameters())
    first = [n["layers.0.mlp.experts.gate_up_proj"], n["layers.0.mlp.experts.down_proj"], n["embed.weight"]]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": first}, {"params": rest, "lr": torch.tensor(5e-3) if tensor_lr else 5e-3}]


PLATEAU_METRIC = [1.0, 1.0, 0.5, 0.5, 0.5, 0.2, 0.2, 0.2]

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], list[Any]]] = {
    # test_lambda_lr: one lambda per group
    "lambda_per_group": lambda o: [S.LambdaLR(o, [lambda e: 0.9**e, lambda e: 1.0 / (1 + e)])],
    # test_step_lr
    "step": lambda o: [S.StepLR(o, step_size=2, gamma=0.5)],
    # test_onecycle_lr_cosine_annealing / test_cycle_lr_with_adam: cycle_momentum moves beta1
    "onecycle_momentum": lambda o: [S.OneCycleLR(o, max_lr=[4e-3, 8e-3], total_steps=STEPS + 1,
                                                 cycle_momentum=True, base_momentum=0.8, max_momentum=0.95)],
    # test_cycle_lr_with_adam (CyclicLR on Adam cycles beta1)
    "cyclic_momentum": lambda o: [S.CyclicLR(o, base_lr=1e-3, max_lr=4e-3, step_size_up=2, cycle_momentum=True,
                                             base_momentum=0.8, max_momentum=0.9)],
    # test_CosineAnnealingWarmRestarts_lr1
    "cosine_warm_restarts": lambda o: [S.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=1e-5)],
    # test_reduce_lr_on_plateau1
    "reduce_on_plateau": lambda o: [S.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=0)],
    # test_sequential_lr1
    "sequential": lambda o: [S.SequentialLR(o, [S.LinearLR(o, start_factor=0.25, total_iters=2),
                                                S.ExponentialLR(o, gamma=0.8)], milestones=[2])],
    # test_chained_lr1 (and two schedulers stepped side by side)
    "chained": lambda o: [S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=2),
                                              S.ExponentialLR(o, gamma=0.9)])],
    "two_side_by_side": lambda o: [S.StepLR(o, step_size=3, gamma=0.3), S.ExponentialLR(o, gamma=0.95)],
}

# (scheduler, dtype, parameters): "groups" = two_groups(), "tensor_lr" = two_groups() with a
# tensor lr in the second group (TestLRScheduler.setUp; schedulers fill it in place),
# "module" = SonarAdamW(model) / AdamW(model.parameters()), one group.
CASES = [(name, torch.float32, "groups") for name in SCHEDULERS] + [
    ("lambda_per_group", torch.bfloat16, "groups"),
    ("onecycle_momentum", torch.bfloat16, "groups"),
    ("lambda_per_group", torch.float32, "tensor_lr"),
    ("step", torch.float32, "tensor_lr"),
] + [(name, torch.float32, "module") for name in SCHEDULERS if name != "lambda_per_group"] + [
    ("onecycle_momentum", torch.bfloat16, "module"),
]
IDS = [f"{n}-{'fp32' if d == torch.float32 else 'bf16'}-{k}" for n, d, k in CASES]

ONE_GROUP = {  # the same schedulers over one group
    "onecycle_momentum": lambda o: [S.OneCycleLR(o, max_lr=4e-3, total_steps=STEPS + 1, cycle_momentum=True,
                                                 base_momentum=0.8, max_momentum=0.95)],
}


def opt_input(model: torch.nn.Module, kind: str, for_torch: bool) -> Any:
    if kind == "module":
        return list(model.parameters()) if for_torch else model
    return two_groups(model, tensor_lr=kind == "tensor_lr")


def step_all(scheds: list[Any], s: int) -> None:
    for sch in scheds:
        if isinstance(sch, S.ReduceLROnPlateau):
            sch.step(PLATEAU_METRIC[s])
        else:
            sch.step()


def group_view(opt: torch.optim.Optimizer) -> list[tuple[Any, Any]]:
    return [(g["lr"], g["betas"]) for g in opt.param_groups]


@pytest.mark.parametrize("name,dtype,kind", CASES, ids=IDS)
def test_scheduler_drives_sonar_as_torch(name: str, dtype: torch.dtype, kind: str) -> None:
    model = make_model(dtype)
    ref = clone_model(model)
    ropt = torch.optim.AdamW(opt_input(ref, kind, True), **HP)
    make = ONE_GROUP.get(name, SCHEDULERS[name]) if kind == "module" else SCHEDULERS[name]
    with SonarAdamW(opt_input(model, kind, False), **HP) as opt:
        rscheds = make(ropt)
        scheds = make(opt)
        seen: list[Any] = []
        for s in range(STEPS):
            x, y = batch(31, s, dtype)
            train_step(ref, ropt, x, y)
            train_step(model, opt, x, y)
            assert_models_equal(ref, model, f"{name}, step {s + 1}")
            step_all(rscheds, s)
            step_all(scheds, s)
            assert value_equal(group_view(opt), group_view(ropt)), f"{name}: param_groups lr/betas after step {s + 1}"
            for sch, rsch in zip(scheds, rscheds):
                assert value_equal(sch.get_last_lr(), rsch.get_last_lr()), f"{name}: get_last_lr after step {s + 1}"
            seen.append([(float(lr), float(b[0])) for lr, b in group_view(opt)])
        assert len({tuple(v) for v in seen}) > 1, f"{name}: the scheduler never changed the lr"
        if name in ("onecycle_momentum", "cyclic_momentum"):
            assert len({v[0][1] for v in seen}) > 1, "beta1 never changed"
        # two more steps under the last lr, still bitwise
        for s in range(STEPS, STEPS + 2):
            x, y = batch(31, s, dtype)
            train_step(ref, ropt, x, y)
            train_step(model, opt, x, y)
            assert_models_equal(ref, model, f"{name}, step {s + 1}")


# test_lrscheduler.py's "test_*_lr_is_constant_for_constant_epoch" and state round trips aside,
# a scheduler's state_dict restores the same lr into a new optimizer (resume from a checkpoint):
def test_scheduler_resume_into_new_optimizer() -> None:
    model = make_model()
    ref = clone_model(model)
    ropt = torch.optim.AdamW(two_groups(ref), **HP)
    rsched = S.LambdaLR(ropt, [lambda e: 0.9**e, lambda e: math.cos(0.2 * e)])
    with SonarAdamW(two_groups(model), **HP) as opt:
        sched = S.LambdaLR(opt, [lambda e: 0.9**e, lambda e: math.cos(0.2 * e)])
        for s in range(3):
            x, y = batch(32, s)
            train_step(ref, ropt, x, y)
            train_step(model, opt, x, y)
            rsched.step()
            sched.step()
        osd, ssd = opt.state_dict(), sched.state_dict()
    with SonarAdamW(two_groups(model), **HP) as opt2:
        # torch's resume order: scheduler first (its constructor sets the lr), then both states
        sched2 = S.LambdaLR(opt2, [lambda e: 0.9**e, lambda e: math.cos(0.2 * e)])
        opt2.load_state_dict(osd)
        sched2.load_state_dict(ssd)
        assert value_equal(sched2.get_last_lr(), rsched.get_last_lr())
        for s in range(3, 6):
            x, y = batch(32, s)
            train_step(ref, ropt, x, y)
            train_step(model, opt2, x, y)
            rsched.step()
            sched2.step()
            assert_models_equal(ref, model, f"resumed, step {s + 1}")
            assert value_equal(sched2.get_last_lr(), rsched.get_last_lr())
