"""A step the server refuses leaves SonarAdamW usable: the client counts a step only as the
server takes it (the issue: "client step N but server is at step M" for good)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sonar_moe
import sonar_moe.optimizer as sonar_optimizer
from compat_util import batch, expert_names, fwd_bwd, make_model


def test_refused_step_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(seed=3)
    real = sonar_optimizer.torch_scalars
    poisoned: list[int] = []

    def scalars(group: Any, step: float, dtype: Any = None) -> dict[str, Any]:
        out = real(group, step, dtype)
        if step == 2 and not poisoned:  # the server refuses a non-finite scalar, changing nothing
            poisoned.append(1)
            out = {**out, "eps": math.nan}
        return out

    monkeypatch.setattr(sonar_optimizer, "torch_scalars", scalars)
    params = dict(model.named_parameters())
    experts = [params[n] for n in expert_names(model)]
    # The scalars are made once a step for the tensors of a group alike: the first layer's
    # experts get a group of their own, so that the poisoned scalars reach one layer only.
    first = [params[n] for n in expert_names(model) if ".0." in n]
    assert 0 < len(first) < len(experts)
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    with sonar_moe.SonarAdamW([{"params": first}, {"params": rest, "lr": 2e-3}], model=model) as opt:
        x, y = batch(0, 0)
        fwd_bwd(model, x, y)
        opt.step()
        opt.zero_grad()
        x, y = batch(0, 1)
        fwd_bwd(model, x, y)
        with pytest.raises(sonar_moe.SonarError, match="could not apply"):
            opt.step()
        opt.zero_grad()
        assert poisoned, "the refusal was not provoked"
        # The refused tensors stayed at step 1, the others moved to 2; the client counts as the
        # server does (a state_dict is the server's count), and training goes on without errors.
        index = {id(q): i for i, q in enumerate(q for g in opt.param_groups for q in g["params"])}  # state_dict's

        def steps() -> tuple[list[int], list[int]]:
            sd = opt.state_dict()["state"]
            return ([int(opt.state[q]["step"].item()) for q in experts],
                    [int(sd[index[id(q)]]["step"].item()) for q in experts])

        client, server = steps()
        assert client == server and 1 in client and 2 in client, (client, server)
        for step in range(2, 5):
            x, y = batch(0, step)
            fwd_bwd(model, x, y)
            opt.step()
            opt.zero_grad()
        client2, server2 = steps()
        assert client2 == server2 == [c + 3 for c in client], (client2, server2)
        assert all(torch.isfinite(q).all() for q in model.parameters())
