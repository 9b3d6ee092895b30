"""The first argument of SonarAdamW, in every form torch.optim.AdamW takes, and the names of
the parameters where they are known (for finding expert tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._detect import ExpertTensor, find_experts, is_expert_param

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


def module_experts(params: nn.Module | Iterable[Any], model: nn.Module | None) -> dict[int, ExpertTensor | None] | None:
    """Every parameter of the module given (as ``params`` or ``model=``) by ``id``: what
    :func:`find_experts` sees it as, None where it is dense; None when no module is given
    (names or shapes decide)."""
    mods = [m for m in (params if isinstance(params, nn.Module) else None, model) if m is not None]
    if not mods:
        return None
    out: dict[int, ExpertTensor | None] = {}
    for mod in mods:
        found = find_experts(mod)
        for n, p in mod.named_parameters(remove_duplicate=False):
            if out.get(id(p)) is None:
                out[id(p)] = found.get(n)
    return out


def group_names(group: Mapping[str, Any], names: Mapping[int, str]) -> list[str | None]:
    """The name of each parameter of a torch parameter group, None where unknown."""
    given = group.get("param_names")
    if given is not None:
        return [str(n) for n in given]
    return [names.get(id(p)) for p in group["params"]]


def is_expert(name: str | None, p: torch.Tensor, pred: ExpertPredicate | None,
              in_module: Mapping[int, ExpertTensor | None] | None) -> bool:
    """Whether p is an expert tensor: ``pred`` decides where given; else the module's layout
    where a module is known (``in_module``, from :func:`module_experts`); else the name (the
    default predicate); else the shape (every parameter of 3 or more dimensions)."""
    if pred is not None:
        return pred(name or "", p)
    if in_module is not None and id(p) in in_module:
        return in_module[id(p)] is not None
    if name is None:
        return p.dim() >= 3
    return is_expert_param(name, p)


def expert_slices(p: torch.Tensor, in_module: Mapping[int, ExpertTensor | None] | None) -> int:
    """How many experts an expert tensor stacks along dim 0 (what ``split_experts`` splits)."""
    found = in_module.get(id(p)) if in_module is not None else None
    if found is not None:
        return found.experts
    return p.shape[0] if p.dim() >= 3 else 1
