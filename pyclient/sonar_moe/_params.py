"""The first argument of SonarAdamW, in every form torch.optim.AdamW takes, and the names of
the parameters where they are known (for finding expert tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._detect import is_expert_param

ExpertPredicate = Callable[[str, torch.Tensor], bool]


def torch_params(params: nn.Module | Iterable[Any], model: nn.Module | None) -> tuple[list[Any], dict[int, str]]:
    """What to hand torch.optim.Optimizer (a module becomes its parameters) and the names known
    from a module, from ``model=``, or from (name, parameter) pairs."""
    names: dict[int, str] = {}
    for mod in (params if isinstance(params, nn.Module) else None, model):
        if mod is not None:
            for n, p in mod.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n)
    if isinstance(params, nn.Module):
        return list(params.parameters()), names
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {torch.typename(params)}")
    out = list(params)

    def named(e: Any) -> bool:
        return isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], torch.Tensor)

    def plain(entries: list[Any]) -> list[Any]:
        """Record the names; a list mixing (name, tensor) pairs and bare tensors, which torch
        refuses, goes to torch as bare tensors (the names serve expert detection only)."""
        for e in entries:
            if named(e):
                names[id(e[1])] = str(e[0])
        if any(named(e) for e in entries) and not all(named(e) for e in entries):
            return [e[1] if named(e) else e for e in entries]
        return entries

    if out and all(isinstance(item, Mapping) for item in out):
        groups = []
        for item in out:
            g = dict(item)
            ps = g.get("params", [])
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else plain(list(ps))
            groups.append(g)
        return groups, names
    return plain(out), names


def group_names(group: Mapping[str, Any], names: Mapping[int, str]) -> list[str | None]:
    """The name of each parameter of a torch parameter group, None where unknown."""
    given = group.get("param_names")
    if given is not None:
        return [str(n) for n in given]
    return [names.get(id(p)) for p in group["params"]]


def is_expert(name: str | None, p: torch.Tensor, pred: ExpertPredicate | None) -> bool:
    """Expert tensors are found by name where it is known (``pred`` or the default
    predicate), and by shape where it is not: every parameter of 3 or more dimensions."""
    if name is None:
        return pred("", p) if pred is not None else p.dim() >= 3
    return (pred or is_expert_param)(name, p)
