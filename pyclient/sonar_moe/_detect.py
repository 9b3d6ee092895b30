"""Which parameters are expert tensors, how many experts each holds, and how they group.

Two ways to find them:

* :func:`find_experts` walks a module. It knows the layouts of every MoE family of Hugging
  Face transformers (listed in ``docs/models.md``) and of plain PyTorch models built the
  same way. It is what ``SonarAdamW(model)`` uses.
* :func:`is_expert_param` looks at a name and a shape only, for parameters given as
  ``(name, tensor)`` pairs without their module.

An *expert container* is a module reached through an attribute named ``experts``, or whose
class name ends in ``Experts`` (JetMoe's and old GraniteMoe's ``ParallelExperts``); a module
whose path says *shared* is not one (shared experts see every token: dense), nor one whose
class name ends in ``SharedExperts``. Inside a
container, a parameter is an expert tensor when

* the container is a ``ModuleList``/``ModuleDict`` (``ParameterList``/``ParameterDict``) of experts, or the parameter sits under a
  child named ``<i>`` or ``expert_<i>``: one tensor per expert (*per-expert*); the tensors of a
  container go to the server in one request;
* it has 3 or more dimensions: ``[E, ...]`` (*batched*);
* its first dimension is the container's expert count ``E``: expert biases ``[E, N]``
  (gpt-oss), per-expert vectors (*batched*);
* it is 2-D with ``k * E`` rows: experts flattened into ``[E * I, H]`` (DBRX, *flattened*);

and never when it lives under a router or gate (JetMoe keeps its attention router inside the
experts module) or in an adapter a tuner layer added (peft's LoRA: ``lora_A``/``lora_B``). ``E`` comes from the container (its length, or an attribute such as
``num_experts``), else from the modules above it, else from the model's config. Outside
containers, an MoE block that holds an expert count ``E`` and ``nn.Embedding(E, ...)`` tables
keeps one expert per row (Doge, *embedding-rows*). Routers, gates, shared experts and
everything else stay dense.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# Attribute names that hold an expert count, on modules and configs of transformers.
COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
# Sub-configs where a model's config keeps the MoE settings.
_SUB_CONFIGS = ("text_config", "ffn_config", "language_config", "llm_config")

# A child that is one expert of a per-expert container.
_ONE_EXPERT = re.compile(r"\d+|expert_\d+")
# Module names that route tokens (they stay dense even inside an expert container).
_ROUTER = re.compile(r"router.*|gate|gating|.*_gate|classifier")
_ROUTER_CLASS = re.compile(r"Router|Gate|TopK")

# Name-only detection (no module at hand).
# ...experts.<i>.... / ...experts.expert_<i>.... : per-expert modules (Mixtral-style
# ModuleList, Switch-Transformers and NLLB-MoE ModuleDict).
_PER_EXPERT = re.compile(r"^(.*?(?:^|\.)experts)\.(?:\d+|expert_\d+)\.")
# Parameters of an experts module: HF v5 `mlp.experts.gate_up_proj` [E, 2I, H], expert biases
# `experts.gate_up_proj_bias` [E, 2I].
_BATCHED = re.compile(r"(^|\.)experts\.[^.]+$")
# DBRX: `ffn.experts.mlp.w1` [E * I, H].
_FLATTENED = re.compile(r"(^|\.)experts\.mlp\.[^.]+$")
# ParallelExperts weights [E, N, K]: GraniteMoe checkpoints (`block_sparse_moe.input_linear.weight`),
# JetMoe (`mlp.input_linear.weight`, `self_attention.experts.input_linear.weight`).
_PARALLEL = re.compile(r"(^|\.)(input|output)_linear\.weight$")


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor as detection sees it."""

    name: str
    layout: str  # "batched", "flattened", "per-expert" or "embedding-rows"
    experts: int  # experts stacked along dim 0 (1 for one expert's own tensor)
    container: str  # the module whose experts these are (the MoE block's experts)


def find_experts(module: nn.Module) -> dict[str, ExpertTensor]:
    """The expert tensors of ``module`` by parameter name (``named_parameters()`` names)."""
    modules = dict(module.named_modules())
    config = getattr(module, "config", None)
    found: dict[str, ExpertTensor] = {}
    containers: list[str] = []
    for path, m in modules.items():
        if any(path.startswith(c + ".") for c in containers):
            continue  # inside a container already looked through
        if _is_container(path, m):
            containers.append(path)
            count = (len(m) if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict))
                     else _count(path, modules, config))
            for rel, p in m.named_parameters():
                t = _classify(path, m, rel, p, count)
                if t is not None:
                    found[t.name] = t
        else:
            found.update(_embedding_rows(path, m))
    return found


def expert_containers(module: nn.Module) -> list[str]:
    """The paths of the expert containers in ``module`` (outermost ones only), whatever
    their parameters look like."""
    found: list[str] = []
    for path, m in module.named_modules():
        if not any(path.startswith(c + ".") for c in found) and _is_container(path, m):
            found.append(path)
    return found


def _join(path: str, rel: str) -> str:
    return f"{path}.{rel}" if path else rel


def _is_container(path: str, m: nn.Module) -> bool:
    if "shared" in path.lower():
        return False
    cls = type(m).__name__
    return path.rsplit(".", 1)[-1] == "experts" or (cls.endswith("Experts") and not cls.endswith("SharedExperts"))


def _count_of(obj: object) -> int | None:
    for a in COUNT_ATTRS:
        try:
            v = getattr(obj, a, None)
        except Exception:  # noqa: BLE001 - configs may refuse a global read of a per-layer value
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _count(path: str, modules: dict[str, nn.Module], config: object) -> int | None:
    """The expert count of the container at ``path``: its own attribute, else its ancestors', else the config's."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        n = _count_of(modules.get(".".join(parts[:i])))
        if n is not None:
            return n
    for cfg in [config, *(getattr(config, s, None) for s in _SUB_CONFIGS)]:
        n = _count_of(cfg) if cfg is not None else None
        if n is not None:
            return n
    return None


def _routes(m: nn.Module, rel: str) -> bool:
    """Whether the parameter ``rel`` of ``m`` belongs to a router or gate."""
    owner = m
    for comp in rel.split(".")[:-1]:
        owner = getattr(owner, comp)
        if _ROUTER.fullmatch(comp) or _ROUTER_CLASS.search(type(owner).__name__):
            return True
    return False


def _adapter(m: nn.Module, rel: str) -> bool:
    """Whether the parameter ``rel`` of ``m`` belongs to an adapter a tuner layer added (peft's
    LoRA on an experts module or on one expert's Linear: ``lora_A``/``lora_B`` [r*E, in], whose
    rows would pass for flattened experts). Such layers name their adapter attributes in
    ``adapter_layer_names``/``other_param_names`` (peft's ``BaseTunerLayer``); adapters stay dense."""
    owner = m
    for comp in rel.split(".")[:-1]:
        names = (*getattr(owner, "adapter_layer_names", ()), *getattr(owner, "other_param_names", ()))
        if comp in names:
            return True
        owner = getattr(owner, comp)
    return False


def _classify(path: str, m: nn.Module, rel: str, p: torch.Tensor, count: int | None) -> ExpertTensor | None:
    if _routes(m, rel) or _adapter(m, rel):
        return None
    name = _join(path, rel)
    first = rel.split(".", 1)[0]
    if (isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict))
            or ("." in rel and _ONE_EXPERT.fullmatch(first))):
        return ExpertTensor(name, "per-expert", 1, path)
    if p.dim() >= 3:
        return ExpertTensor(name, "batched", p.shape[0], path)
    if count is None or p.dim() == 0:
        return None
    if p.shape[0] == count:
        return ExpertTensor(name, "batched", count, path)
    if p.dim() == 2 and p.shape[0] % count == 0:
        return ExpertTensor(name, "flattened", count, path)
    return None


def _embedding_rows(path: str, m: nn.Module) -> dict[str, ExpertTensor]:
    """Embedding tables of an MoE block with one row per expert (Doge's `down_embed`/`up_embed`)."""
    count = _count_of(m)
    if count is None or count < 2 or not path:
        return {}
    out = {}
    for child, sub in m.named_children():
        if isinstance(sub, nn.Embedding) and sub.num_embeddings == count:
            name = _join(path, f"{child}.weight")
            out[name] = ExpertTensor(name, "embedding-rows", count, path)
    return out


def is_expert_param(name: str, param: torch.Tensor) -> bool:
    """Name-and-shape detection, for parameters known by name only (no module).

    Per-expert modules (``...experts.<i>.``, ``...experts.expert_<i>.``), parameters of an
    ``experts`` module with 2 or more dimensions (batched ``[E, ...]`` tensors, expert biases
    ``[E, N]``), DBRX's flattened ``experts.mlp.*`` and 3-D ``input_linear``/``output_linear``
    weights (ParallelExperts). With the module at hand, :func:`find_experts` is more exact.
    """
    if _PER_EXPERT.match(name):
        return True
    if param.dim() >= 2 and (_BATCHED.search(name) or _FLATTENED.search(name)):
        return True
    return param.dim() >= 3 and bool(_PARALLEL.search(name))


def group_key(name: str) -> str:
    """The MoE block an expert tensor belongs to. A block's expert tensors go to the server in
    one request (once each has its gradient of this backward), and the gradient ring holds
    whole blocks.

    The block is the name up to its last layer index before the last ``experts`` component
    (``model.layers.3`` for OLMoE's ``model.layers.3.mlp.experts.gate_up_proj``, GraniteMoe's
    ``model.layers.3.block_sparse_moe.input_linear.weight`` and a per-expert
    ``model.layers.3.mlp.experts.5.down_proj.weight`` alike; ``encoder.block.0.layer.1`` for
    Switch Transformers). A name without a layer index is its own block, except per-expert
    parameters, which share their ``experts`` container's."""
    parts = name.split(".")
    at = [i for i, c in enumerate(parts) if c == "experts"]
    head = parts[:at[-1]] if at else parts[:-1]
    index = [i for i, c in enumerate(head) if c.isdigit()]
    if index:
        return ".".join(head[:index[-1] + 1])
    m = _PER_EXPERT.match(name)
    return m.group(1) if m else name
