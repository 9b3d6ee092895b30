"""Expert tensors that are DTensors: sharded by FSDP2 (``fully_shard``), by transformers'
tensor or expert parallel loading (``tp_plan``, ``distributed_config``), or any DTensor
whose placements hold the parameter's values (``Shard``, its strided form, ``Replicate``;
not ``Partial``).

AdamW is element-wise, and on a DTensor torch's AdamW runs its arithmetic on each rank's local
tensor. So sonard updates each rank's local shard as an expert tensor of its own, and the
rest of Sonar works on that local tensor (:func:`local`): its memory, its gradient, its state.
What a script sees stays torch's: the parameter is the same DTensor object, ``opt.state`` and
``state_dict()`` hold DTensor moments with the parameter's mesh and placements (:func:`like`),
and a loaded DTensor state gives its local tensor (:func:`local_state`).

Moving a local shard into shared memory (:func:`adopt`) points the tensor the DTensor wraps at
the new memory (``.data``, as for a plain parameter; the wrapped tensor is found through the
traceable-subclass protocol, ``__tensor_flatten__``), so the ``Parameter`` and its local tensor
stay the same objects, and then runs the module's ``load_state_dict`` post-hooks: FSDP2
re-reads each parameter's local tensor there, so that its all-gathers read the memory sonard
updates (before its first forward, FSDP2's lazy initialization would also do it; after it, only
these hooks do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Partial, Shard
except ImportError:  # a torch built without torch.distributed has no DTensor
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor of this rank: a DTensor's local tensor, else t itself."""
    if DTensor is None or not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # to_local() outside autograd is the local tensor itself, no view
        return t.to_local()


def _spec(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """A DTensor's mesh and placements."""
    d: Any = t
    return d.device_mesh, tuple(d.placements)


def like(param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A state tensor of param's local shape as torch's AdamW keeps it for param: a DTensor
    with param's mesh and placements where param is one, else t."""
    if not is_dtensor(param):
        return t
    mesh, placements = _spec(param)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


def local_state(name: str, key: str, param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The local part of a state tensor given for param (opt.state, a loaded state_dict)."""
    if not is_dtensor(param):
        if is_dtensor(t):
            raise ValueError(f"state {key} of expert tensor {name} is a DTensor, and the tensor is not")
        return t
    mesh, placements = _spec(param)
    if not is_dtensor(t):
        raise ValueError(f"state {key} of expert tensor {name} is a plain tensor, and the tensor is a DTensor "
                         f"({placements}): give DTensor state with its mesh and placements, as torch's AdamW keeps "
                         "it (a torch.distributed.checkpoint load does)")
    if _spec(t) != (mesh, placements):
        raise ValueError(f"state {key} of expert tensor {name} is sharded as {_spec(t)[1]} on {_spec(t)[0]}, the "
                         f"tensor as {placements} on {mesh}")
    return local(t)


def check(name: str, p: torch.Tensor) -> None:
    """Refuse a DTensor expert tensor whose local tensor is not what AdamW would update here."""
    if not is_dtensor(p):
        return
    if p.device.type != "cpu":
        raise NotImplementedError(f"expert tensor {name} is a DTensor on {p.device}: DTensor (FSDP2) expert tensors "
                                  "are supported on CPU; on CUDA this path has not run on a GPU yet")
    mesh, placements = _spec(p)
    if any(isinstance(pl, Partial) for pl in placements):
        raise ValueError(f"expert tensor {name} is a DTensor placed as {placements}: a Partial placement holds "
                         "a term of a sum on each rank, not the parameter's values, which AdamW updates")
    for dim, pl in enumerate(placements):
        if isinstance(pl, Shard) and p.shape[pl.dim] % mesh.size(dim):
            raise ValueError(f"expert tensor {name} is a DTensor of {tuple(p.shape)} sharded as {placements} on "
                             f"{mesh}: dim {pl.dim} does not divide evenly, and FSDP2 pads such shards into "
                             "memory of its own. Make it divisible by the mesh size, or leave the tensor out of "
                             "fully_shard (ignored_params, expert parallel)")
    if not local(p).is_contiguous():
        raise ValueError(f"expert tensor {name}: its DTensor's local tensor is not contiguous")


def adopt(module: nn.Module | None, name: str, p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (filled with p's local values) p's local tensor, in place of the old one."""
    if module is None:
        raise ValueError(f"expert tensor {name} is a DTensor: its model is needed to move it")
    wrapper: Any = p
    inner, _ = wrapper.__tensor_flatten__()  # a DTensor wraps one tensor: its local one
    getattr(p, inner[0]).data = view
    # FSDP2 registers a post-hook on each sharded module that re-reads its parameters' local tensors
    # (and pads them); loading nothing runs every module's post-hooks.
    module.load_state_dict({}, strict=False)
    got = local(p)
    if got.data_ptr() != view.data_ptr() or got.shape != view.shape:
        raise ValueError(f"expert tensor {name} (a DTensor of {tuple(p.shape)} placed as {_spec(p)[1]}): its "
                         "local shard did not stay in the shared memory sonard updates: FSDP2 moved it into memory "
                         "of its own (it does so for padded shards, and for pinned memory with CPUOffloadPolicy)")


def _mesh(t: torch.Tensor) -> Any:
    """A DTensor's mesh; None for a plain tensor."""
    return _spec(t)[0] if is_dtensor(t) else None


def one_kind(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are all plain tensors, or all DTensors of one mesh: what one
    ``_foreach_`` operator takes (it refuses DTensors beside tensors, and meshes apart)."""
    return len({_mesh(t) for t in tensors}) <= 1


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, also where the gradients are
    DTensors of several meshes or DTensors beside plain tensors, which it refuses (transformers'
    tensor-parallel loading leaves sharded weights beside replicated norms): the norm of each
    mesh's gradients (a DTensor norm reduced over its mesh), the norm of those, and each group
    clipped by it, as transformers' Trainer clips such a model (its ``_mixed_mesh_grad_norm``).
    Returns the total norm."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh(p.grad), []).append(p)
    if len(groups) < 2:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in groups.values():
        norm: Any = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
