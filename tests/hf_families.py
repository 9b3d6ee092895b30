"""Every Mixture-of-Experts family of the installed transformers, built tiny from its config.

Families are discovered, not listed: every config class of ``CONFIG_MAPPING`` that carries an
expert count (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``,
or DBRX's ``ffn_config.moe_num_experts``) is one, so a new family of a newer transformers is
picked up. Composite (multimodal) configs are represented by their MoE text config. The model
built is the family's causal LM where it has one, else its seq2seq LM, else its base model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS = 4
TOP_K = 2
VOCAB = 128
HIDDEN = 32
LAYERS = 2

# Sizes every family gets where its config has the attribute (the defaults are full-size models).
_TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "d_model": HIDDEN, "intermediate_size": 32, "d_ff": 32,
    "ffn_dim": 32, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "ffn_hidden_size": 16,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "expert_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16, "shared_experts_intermediate_size": 16, "shared_intermediate_size": 16,
    "dense_intermediate_size": 32, "share_expert_dim": 16, "moe_hidden_size": 16, "router_hidden_size": 16,
    "o_lora_rank": 16, "o_groups": 2, "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "global_head_dim": 16,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS, "num_decoder_layers": LAYERS,
    "encoder_layers": LAYERS, "decoder_layers": LAYERS, "num_sparse_encoder_layers": 1,
    "num_sparse_decoder_layers": 1, "encoder_sparse_step": 1, "decoder_sparse_step": 1,
    "num_attention_heads": 2, "n_heads": 2, "num_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "kv_channels": 16, "max_position_embeddings": 64, "tie_word_embeddings": False,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_k": TOP_K, "moe_topk": TOP_K,
    "moe_top_k": TOP_K, "top_k_experts": TOP_K, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": 1,
    "topk_group": 1, "num_expert_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 16, "expert_capacity": 64,
    "mlp_layer_types": ["sparse"] * LAYERS, "mlp_only_layers": [], "linear_num_heads": 2, "linear_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                      # the transformers.models package
    model_type: str
    config_class: type[PretrainedConfig]
    count_attr: str                # where the expert count is set


def _count_attr(cls: type[PretrainedConfig]) -> str | None:
    try:
        cfg = cls()
    except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is not a candidate
        return None
    keys = set(cfg.to_dict()) | set(getattr(cls, "attribute_map", {}))
    for a in EXPERT_COUNT_ATTRS:
        if a in keys:
            return a
    ffn = getattr(cfg, "ffn_config", None)
    if ffn is not None and hasattr(ffn, "moe_num_experts"):
        return "ffn_config.moe_num_experts"
    return None


def moe_families() -> list[Family]:
    """One Family per MoE config class registered in transformers (text configs of composites)."""
    out: dict[str, Family] = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a family whose dependencies are missing
            continue
        attr = _count_attr(cls)
        if attr is None:
            continue
        pkg = cls.__module__.split(".")[2]
        out[model_type] = Family(pkg, model_type, cls, attr)
    return list(out.values())


_PREFERENCE = ("ForCausalLM", "ForConditionalGeneration", "Model", "Backbone")


def model_class(family: Family) -> type[PreTrainedModel] | None:
    """The family's LM head model for this config (causal, else seq2seq), else its base model."""
    found: list[type[PreTrainedModel]] = []
    for mod_name in _modeling_modules(family.name):
        mod = importlib.import_module(f"transformers.models.{family.name}.{mod_name}")
        found += [c for c in vars(mod).values()
                  if inspect.isclass(c) and issubclass(c, PreTrainedModel) and c.config_class is family.config_class
                  and c not in found]
    for suffix in _PREFERENCE:
        for c in found:
            if c.__name__.endswith(suffix) and not c.__name__.endswith("PreTrainedModel"):
                return c
    return _auto_model_class(family.model_type)


def _auto_model_class(model_type: str) -> type[PreTrainedModel] | None:
    """The model class transformers' auto classes build for a family without modeling code of its
    own (transformers 5.25's param2moe and sarvam_moe are GLM-4 MoE models, sarvam_mla a DeepSeek-V3)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    for names in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                  auto.MODEL_MAPPING_NAMES):
        name = names.get(model_type)
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if inspect.isclass(cls) and issubclass(cls, PreTrainedModel):
            return cls
    return None


def _modeling_modules(pkg_name: str) -> list[str]:
    pkg = importlib.import_module(f"transformers.models.{pkg_name}")
    return [m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("modeling_")]


def tiny_config(family: Family) -> PretrainedConfig:
    """The family's config with small sizes and EXPERTS experts (top-TOP_K)."""
    cls = family.config_class
    keys = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    kw = {k: v for k, v in _TINY.items() if k in keys}
    kw.update({a: EXPERTS for a in EXPERT_COUNT_ATTRS if a in keys})
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # multi-head latent attention: rope over qk_rope_head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "use_cache" in keys:
        kw["use_cache"] = False  # training (hybrid linear-attention caches refuse some queries)
    kw.update(_FAMILY_OVERRIDES.get(family.model_type, {}))
    if family.count_attr == "ffn_config.moe_num_experts":
        kw["ffn_config"] = {"moe_num_experts": EXPERTS, "moe_top_k": TOP_K, "ffn_hidden_size": 16}
    else:
        kw[family.count_attr] = EXPERTS
    return cls(**kw)


# What the common sizes leave wrong in some families: MoE layers switched off by default, counts
# that must agree, full-size tables the common keys do not reach.
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},  # clip_qkv=None fails in forward
    "doge": {"is_moe": True},
    "dots3_note_text": {"num_key_value_heads": 2},
    "ernie4_5_vl_moe_text": {"moe_intermediate_size": [16, 16], "head_dim": 128},
    "gemma4_text": {"enable_moe_block": True, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    "glm5_next_text": {"num_key_value_heads": 2, "qk_rope_head_dim": 0},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 16},
    "lfm2_moe": {"num_dense_layers": 0, "layer_types": ["full_attention", "conv"]},
    "longcat_flash": {"zero_expert_num": 2},
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 16},
    "switch_transformers": {"decoder_start_token_id": 0},
    "deepseek_v4": {"mlp_layer_types": ["moe"] * LAYERS},
    "glm4v_moe_text": {"head_dim": 128},  # its 3-D rope sections span 64 rotary dims (half the head)
    "mistral4": {"head_dim": 16},
    "mimo_v2_flash": {"head_dim": 24, "num_key_value_heads": 1},  # a third rotates (8 dims); sliding layers double the kv heads
    "step3p5": {"sliding_window": 8},
    "zaya": {"num_experts_per_tok": 1},
    "hy_v4_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
    "kolibri1_1": {"index_num_heads": 1},  # at most the query heads per key head
    # vision encoders with MoE MLPs
    "dots3_note_vision_encoder": {"pyramid_num_routed": [EXPERTS] * LAYERS, "adapter_in_dim": HIDDEN,
                                  "adapter_out_dim": HIDDEN, "patch_size": 4, "num_experts_per_tok": TOP_K},
    "vitpose_backbone": {"image_size": [32, 32], "patch_size": [8, 8], "part_features": 8, "mlp_ratio": 2},
}


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build(family: Family, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A tiny model of the family, random init from ``seed``, in training mode."""
    cls = model_class(family)
    if cls is None:
        raise LookupError(f"no model class with config {family.config_class.__name__}")
    cfg = tiny_config(family)
    with _seeded(seed), _nan_for_uninitialized():
        # transformers' PreTrainedModel.to is @wraps(nn.Module.to): mypy binds no self, takes dtype for it
        model = cls(cfg).to(dtype)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and torch.isnan(p).any():  # left uninitialized by the family's init
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model.train()


@contextlib.contextmanager
def _nan_for_uninitialized() -> Iterator[None]:
    """Memory torch.empty hands out is NaN meanwhile (some families do not initialize every
    parameter when built alone: Qwen3-Omni's talker leaves its experts empty)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # (fill_uninitialized_memory is a property of torch.utils.deterministic's module class: torch's
    # typing does not show it)
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def inputs(model: PreTrainedModel, step: int) -> dict[str, torch.Tensor | bool]:
    """A random batch for the model: token ids (with labels for an LM head), or images."""
    g = torch.Generator().manual_seed(1000 + step)
    if model.main_input_name != "pixel_values":
        ids = torch.randint(3, VOCAB, (2, 16), generator=g)
        batch: dict[str, torch.Tensor | bool] = ({"input_ids": ids} if _has_token_embeddings(model) else
                                                 {"inputs_embeds": torch.randn(2, 16, HIDDEN, generator=g)})
        if type(model).__name__.endswith(("ForCausalLM", "ForConditionalGeneration")):
            batch["labels"] = torch.randint(3, VOCAB, (2, 16), generator=g)
        if "use_cache" in inspect.signature(model.forward).parameters:
            batch["use_cache"] = False  # training; hybrid (linear attention) caches refuse some queries
        return batch
    cfg = model.config
    forward = inspect.signature(model.forward).parameters
    if "grid_thw" in forward:  # flattened patches of a 4 x 4 patch grid (Qwen-VL style)
        patch = cfg.num_channels * cfg.patch_size ** 2
        return {"pixel_values": torch.randn(16, patch, generator=g), "grid_thw": torch.tensor([[1, 4, 4]])}
    size = cfg.image_size if isinstance(cfg.image_size, (list, tuple)) else (cfg.image_size, cfg.image_size)
    batch = {"pixel_values": torch.randn(2, cfg.num_channels, *size, generator=g)}
    if "dataset_index" in forward:  # ViTPose+: the dataset picks the expert
        batch["dataset_index"] = torch.tensor([step % EXPERTS, (step + 1) % EXPERTS])
    return batch


def _has_token_embeddings(model: nn.Module) -> bool:
    """Whether the model embeds token ids itself (Qwen3-Omni's talker takes embeddings from the thinker)."""
    return not type(model).__name__.startswith("Qwen3OmniMoeTalker")


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor | bool], seed: int) -> torch.Tensor:
    """The model's loss with labels, else a random linear readout of its output. Dropout and random routing
    (NLLB-MoE's sampled second expert, router jitter) draw from ``seed``, so two runs over equal
    models see the same randomness."""
    fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # some models write their inputs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model(**fresh)
    if "labels" in batch:
        return out.loss
    feats = out.feature_maps if getattr(out, "feature_maps", None) is not None else (out.last_hidden_state,)
    g = torch.Generator().manual_seed(seed)  # a fixed random readout (the outputs may be normalized: no pow(2))
    return sum((f.float() * torch.randn(f.shape, generator=g)).mean() for f in feats)
