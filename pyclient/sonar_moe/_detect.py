"""Which parameters are expert tensors, and how they group into one request per layer."""

from __future__ import annotations

import re

import torch

# ...experts.<i>.... : per-expert ModuleList layouts (Mixtral-style, this repo's tiny model).
_PER_EXPERT = re.compile(r"^(.*?(?:^|\.)experts)\.(\d+)\.")
# Batched [E, ...] tensors: HF v5 OLMoE/Qwen/Mixtral `mlp.experts.gate_up_proj`/`down_proj`,
# GraniteMoe `block_sparse_moe.experts.gate_up_proj`/`down_proj` (transformers 5.x renames the
# checkpoint names `block_sparse_moe.input_linear.weight`/`output_linear.weight`, also accepted).
_BATCHED = re.compile(r"(^|\.)experts\.[^.]+$|(^|\.)block_sparse_moe\.(input|output)_linear\.weight$")


def is_expert_param(name: str, param: torch.Tensor) -> bool:
    """Default predicate: batched expert tensors (3D or more) and per-expert ModuleList params.

    Routers (`mlp.gate`, `block_sparse_moe.router`) and shared dense layers stay dense.
    """
    if _PER_EXPERT.match(name):
        return True
    return param.dim() >= 3 and bool(_BATCHED.search(name))


def group_key(name: str) -> str:
    """Tensors with the same key go to the server in one request: a layer's per-expert
    ModuleList parameters share the layer's key; a batched tensor is its own group."""
    m = _PER_EXPERT.match(name)
    return m.group(1) if m else name
