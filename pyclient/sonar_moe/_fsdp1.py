"""Expert tensors that FSDP1 (``FullyShardedDataParallel``) flattened.

FSDP1 concatenates the parameters of each unit it wraps into one flat parameter and shards
that. With ``use_orig_params=False`` the optimizer sees only the flat parameters. With
``use_orig_params=True`` it sees each original parameter as a 1-D view of this rank's piece
of the flat one, all of a unit's views sharing its memory. Either way no expert tensor is left
whose gradient is final on its own: FSDP1 reduce-scatters a unit's gradients into one flat
gradient and frees it as a whole. SonarAdamW cannot update or free them during backward.
FSDP2 (``fully_shard``) keeps each parameter a DTensor of its own, which SonarAdamW supports
(``sonar_moe/_dtensor.py``).

:func:`flattened` finds the expert containers FSDP1 flattened: those inside a
``FullyShardedDataParallel`` unit that hold no parameter of two or more dimensions. An experts
module FSDP1 was told to ignore (``ignored_modules``) keeps its own tensors, and
detection finds them as usual.

``max_grad_norm`` is refused under FSDP1 (:data:`CLIPPING`): SonarAdamW clips the dense
gradients as ``torch.nn.utils.clip_grad_norm_`` does, which on FSDP1's plain tensors measures
this rank's shards only. FSDP1's own ``clip_grad_norm_`` measures them all.
"""

from __future__ import annotations

from torch import nn

from ._detect import expert_containers

try:
    from torch.distributed.fsdp import FullyShardedDataParallel
except ImportError:  # a torch built without torch.distributed
    FullyShardedDataParallel = None  # type: ignore[assignment,misc]

ADVICE = ("FSDP1 (FullyShardedDataParallel) flattens each wrapped unit's parameters into one flat "
          "parameter, so no expert tensor has a gradient of its own to update and free during backward. "
          "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard; each layer's experts module "
          "first, docs/distributed.md, section 4), or use DDP")

CLIPPING = ("max_grad_norm under FSDP1 (FullyShardedDataParallel) would clip each rank's gradients by the norm "
            "of its own shards (FSDP1's gradients are plain tensors, torch.nn.utils.clip_grad_norm_ cannot see "
            "the other ranks'). Call FSDP1's own model.clip_grad_norm_(max_norm) before step() instead, which "
            "measures every rank's shards")


def units(module: nn.Module | None) -> list[str]:
    """The paths of the FSDP1 units in ``module``."""
    if module is None or FullyShardedDataParallel is None:
        return []
    return [path for path, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]


def flattened(module: nn.Module | None) -> list[str]:
    """The expert containers of ``module`` whose tensors FSDP1 flattened (their paths)."""
    wrapped = units(module)
    if module is None or not wrapped:
        return []
    modules = dict(module.named_modules())
    out = []
    for path in expert_containers(module):
        if _under(path, wrapped) and all(p.dim() < 2 for p in modules[path].parameters()):
            out.append(path)
    return out


def flat_part(name: str, containers: list[str]) -> bool:
    """Whether the parameter ``name`` is FSDP1's flat parameter (``_flat_param``) or a view of
    one: a parameter of one of the flattened ``containers``."""
    if containers and name.rsplit(".", 1)[-1] == "_flat_param":
        return True
    return _under(name, containers)


def _under(name: str, paths: list[str]) -> bool:
    """Whether ``name`` lies inside one of the modules at ``paths`` ("" is the root)."""
    return any(p == "" or name.startswith(p + ".") for p in paths)
