"""Tiny Hugging Face MoE models (random init from a config, no download) and byte-level text.

The models use transformers v5 layouts: batched expert tensors
``...experts.gate_up_proj`` ``[E, 2I, H]`` and ``...experts.down_proj`` ``[E, H, I]``. Both the
OLMoE and the GraniteMoe experts class carry ``@use_experts_implementation``: the forward is
chosen at run time from ``config._experts_implementation`` (``from_config(...,
experts_implementation=...)`` sets it; ``None`` resolves to ``"grouped_mm"``, or ``"eager"``
where grouped_mm cannot dispatch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, GraniteMoeConfig, OlmoeConfig
from transformers import GraniteMoeForCausalLM, OlmoeForCausalLM

import tiny_moe

# Experts implementations that run forward and backward on CPU (transformers 5.23, torch 2.15):
# - "eager": a Python loop over the experts that got tokens (`gate_up_proj[e]` per expert);
# - "grouped_mm": tokens sorted by expert, one `torch.nn.functional.grouped_mm` per projection
#   (CPU kernel since torch 2.9; transformers falls back to a loop of mm for torch <= 2.10 on
#   unaligned weights);
# - "batched_mm": each (token, expert) pair gathers its expert's weight and runs one bmm.
# Not on CPU, so not tested here: "deepgemm" (bfloat16 only, needs CUDA and the `kernels`
# package: ImportError) and "sonicmoe" (needs the `kernels` package and CUDA: ImportError).
CPU_EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")

# (implementation, dtype) pairs whose expert gradients are NOT reproducible run to run on CPU
# with more than one torch thread: batched_mm gathers `gate_up_proj[expert_ids]`, whose
# backward is `index_put_(..., accumulate=True)`, and torch's CPU kernel for that op adds
# float32 in parallel in no fixed order (bfloat16 runs serially). The same model and batch
# backpropagated twice gives gradients that differ in the last bits, so no optimizer can be
# bitwise equal to a reference under it. `torch.use_deterministic_algorithms(True)` selects
# the sorted, deterministic kernel.
NONDETERMINISTIC_ON_CPU = {("batched_mm", torch.float32)}

VOCAB = 256  # byte-level: every byte value is a token
HIDDEN = 64
INTERMEDIATE = 32
LAYERS = 2
EXPERTS = 8
TOP_K = 2
HEADS = 4
MAX_POSITIONS = 64

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=HEADS, num_experts_per_tok=TOP_K,
    max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """With a seed, initialise from it without touching the global RNG; else use the global RNG."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_olmoe(experts_implementation: str = "eager", dtype: torch.dtype = torch.float32, *,
               seed: int | None = None, num_layers: int = LAYERS) -> OlmoeForCausalLM:
    """A small OLMoE (8 experts, top-2, hidden 64, vocab 256) in training mode.

    Deterministic for a given ``seed`` (or, with ``seed=None``, for the global RNG state).
    """
    cfg = OlmoeConfig(**{**_COMMON, "num_hidden_layers": num_layers}, num_experts=EXPERTS)
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation, dtype=dtype)
    assert isinstance(model, OlmoeForCausalLM)
    assert model.config._experts_implementation == experts_implementation, model.config._experts_implementation
    return model.train()


def tiny_granite(dtype: torch.dtype = torch.float32, *, experts_implementation: str = "eager",
                 seed: int | None = None, num_layers: int = LAYERS) -> GraniteMoeForCausalLM:
    """A small GraniteMoe (8 experts, top-2, hidden 64, vocab 256) in training mode.

    Non-unit Granite multipliers, so the scaled residual/embedding/logit paths are exercised.
    """
    cfg = GraniteMoeConfig(
        **{**_COMMON, "num_hidden_layers": num_layers}, num_local_experts=EXPERTS,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0,
    )
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation, dtype=dtype)
    assert isinstance(model, GraniteMoeForCausalLM)
    assert model.config._experts_implementation == experts_implementation, model.config._experts_implementation
    return model.train()


def expected_expert_names(model: OlmoeForCausalLM | GraniteMoeForCausalLM) -> list[str]:
    """The batched expert tensors of a tiny OLMoE/GraniteMoe, in named_parameters() order.

    GraniteMoe checkpoints store ``block_sparse_moe.input_linear.weight`` /
    ``output_linear.weight``; transformers 5.x renames them on load to the common
    ``block_sparse_moe.experts.gate_up_proj`` / ``down_proj`` layout (see
    ``transformers/conversion_mapping.py``), which is what the module has. Whichever layout
    this transformers builds is the one expected here.
    """
    names = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "mlp"):  # OLMoE
            names += [f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"]
        elif hasattr(layer.block_sparse_moe, "input_linear"):  # GraniteMoe, transformers < 5 layout
            names += [f"model.layers.{i}.block_sparse_moe.input_linear.weight",
                      f"model.layers.{i}.block_sparse_moe.output_linear.weight"]
        else:  # GraniteMoe, transformers 5 layout
            names += [f"model.layers.{i}.block_sparse_moe.experts.gate_up_proj",
                      f"model.layers.{i}.block_sparse_moe.experts.down_proj"]
    return names


def router_names(model: torch.nn.Module) -> list[str]:
    """The router weights (must stay dense)."""
    return [n for n, _ in model.named_parameters()
            if n.endswith(".mlp.gate.weight") or n.endswith(".block_sparse_moe.router.weight")]


@functools.lru_cache(maxsize=None)
def corpus(max_bytes: int = 300_000) -> bytes:
    """Real text: the standard library's Python sources (deterministic for a Python install)."""
    return tiny_moe.load_corpus(max_bytes)


def text_batches(seed: int, batch: int = 2, seq: int = 32, count: int | None = None,
                 data: bytes | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Random byte windows of real text as ``{"input_ids", "labels"}`` (the model shifts the labels)."""
    gen = torch.Generator().manual_seed(seed)
    for x in tiny_moe.batches(corpus() if data is None else data, batch, seq, gen, count=count):
        yield {"input_ids": x, "labels": x.clone()}


class Windows(Dataset):
    """Byte windows of real text (Python stdlib sources)."""

    def __init__(self, n: int = 64, seq: int = 24, seed: int = 0) -> None:
        data = torch.frombuffer(bytearray(tiny_moe.load_corpus(200_000)), dtype=torch.uint8).long()
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(data) - seq, (n,), generator=g)
        self.rows = [data[s: s + seq].clone() for s in starts]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
