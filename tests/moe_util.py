"""A small model with batched expert tensors (HF v5 names), shared by the tests that train it
against ``torch.optim.AdamW`` (tests/test_zero_copy.py, tests/test_openmp_park.py), and the
side-by-side training loop they run; and the torch.distributed.checkpoint save and load the
distributed workers (tests/launch_worker.py, tests/dist_worker.py) run for each method."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn


class TinyMoE(nn.Module):
    """Two layers of batched experts (``experts`` of them, ``hidden`` wide, ``inter`` in the
    middle: gate_up_proj [experts, 2*inter, hidden], down_proj [experts, hidden, inter]) and a
    dense projection."""

    def __init__(self, dtype: torch.dtype, experts: int = 4, hidden: int = 9, inter: int = 11) -> None:
        super().__init__()
        self.inter = inter
        self.layers = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.mlp = nn.Module()
            blk.mlp.experts = nn.Module()
            blk.mlp.experts.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden, dtype=dtype))
            blk.mlp.experts.down_proj = nn.Parameter(torch.randn(experts, hidden, inter, dtype=dtype))
            self.layers.append(blk)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blk: Any  # a plain nn.Module given its submodules and parameters in __init__: no class types them
        for blk in self.layers:
            e = blk.mlp.experts
            h = torch.einsum("bh,eih->bei", x, e.gate_up_proj)
            h = torch.nn.functional.silu(h[..., :self.inter]) * h[..., self.inter:]
            x = torch.tanh(self.proj(torch.einsum("bei,ehi->beh", h, e.down_proj).mean(1)))
        return x.float().pow(2).mean()


def train_beside(model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, topt: torch.optim.Optimizer,
                 batch: Callable[[], torch.Tensor], steps: int, micro: int = 1,
                 before_ref_step: Callable[[], object] | None = None) -> None:
    """Train model with opt and its copy ref with torch's optimizer topt on the same batches:
    `micro` backward passes a step (one batch() each, fed to both), opt's step, then
    before_ref_step (the reference's clipping) and topt's."""
    for _ in range(steps):
        for _ in range(micro):
            x = batch()
            model(x).backward()
            ref(x).backward()
        opt.step()
        opt.zero_grad()
        if before_ref_step is not None:
            before_ref_step()
        topt.step()
        topt.zero_grad()


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter of model has the bits of ref's."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


Trained = Mapping[str, tuple[nn.Module, torch.optim.Optimizer]]


def dcp_save(runs: Trained, out: Path) -> None:
    """Each run's model and optimizer (``get_state_dict``) saved by ``dcp.save`` under out/name."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    for name, (model, opt) in runs.items():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / name)


def dcp_load(runs: Trained, out: Path) -> None:
    """Each run's model and optimizer loaded from out/name (``dcp.load`` in place, then ``set_state_dict``)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    for name, (model, opt) in runs.items():
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=out / name)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
