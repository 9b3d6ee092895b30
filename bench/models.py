"""Model configurations of the training benchmark: the real OLMoE-1B-7B and
Granite-3.1-3B-A800M shapes (counted on the meta device, nothing downloaded) and small
byte-level configs whose expert share of parameters matches them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GraniteMoeConfig, OlmoeConfig, PreTrainedModel

# Published shapes (config.json of allenai/OLMoE-1B-7B-0924 and ibm-granite/granite-3.1-3b-a800m-base).
REAL: dict[str, dict[str, Any]] = {
    "olmoe": dict(name="OLMoE-1B-7B", vocab=50304, hidden=2048, intermediate=1024, layers=16, heads=16,
                  kv_heads=16, experts=64, top_k=8, tie=False),
    "granite": dict(name="Granite-3.1-3B-A800M", vocab=49155, hidden=1536, intermediate=512, layers=32, heads=24,
                    kv_heads=8, experts=40, top_k=8, tie=True),
}


@dataclass
class Shape:
    kind: str  # "olmoe" or "granite"
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    tie: bool
    max_positions: int = 512

    def config(self) -> OlmoeConfig | GraniteMoeConfig:
        common: dict[str, Any] = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, num_experts_per_tok=self.top_k,
            max_position_embeddings=self.max_positions, tie_word_embeddings=self.tie,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if self.kind == "olmoe":
            return OlmoeConfig(**common, num_experts=self.experts)
        return GraniteMoeConfig(**common, num_local_experts=self.experts)

    def build(self, experts_implementation: str, dtype: torch.dtype, seed: int) -> PreTrainedModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(self.config(), experts_implementation=experts_implementation,
                                                 dtype=dtype)
        assert m.config._experts_implementation == experts_implementation
        return m.train()

    def counts(self) -> dict:
        """Total and expert parameter counts (meta device: no memory)."""
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(self.config())
        total = expert = 0
        per_layer_expert = 0
        for n, p in m.named_parameters():
            total += p.numel()
            if is_expert(n, p):
                expert += p.numel()
                if ".layers.0." in n:
                    per_layer_expert += p.numel()
        return {"total": total, "expert": expert, "share": expert / total, "expert_per_layer": per_layer_expert}

    def asdict(self) -> dict:
        return asdict(self)


def is_expert(name: str, p: torch.Tensor) -> bool:
    import sonar_moe
    return sonar_moe.is_expert_param(name, p)


def real_shape(kind: str) -> Shape:
    r = REAL[kind]
    return Shape(kind, r["vocab"], r["hidden"], r["intermediate"], r["layers"], r["heads"], r["kv_heads"],
                 r["experts"], r["top_k"], r["tie"], 4096)


def small_shape(kind: str, hidden: int, layers: int) -> tuple[Shape, dict, dict]:
    """A byte-level (vocab 256) config of `kind` with the real expert count and top-k, the
    given hidden size and depth, and the intermediate size (multiple of 8) whose expert
    share of parameters is closest to the real model's."""
    real = real_shape(kind)
    target = real.counts()
    heads, kv = (4, 4) if kind == "olmoe" else (4, 2)  # OLMoE: MHA; Granite: GQA
    best: tuple[float, Shape, dict] | None = None
    for inter in range(8, 4 * hidden + 1, 8):
        s = Shape(kind, 256, hidden, inter, layers, heads, kv, real.experts, real.top_k, kind == "granite")
        c = s.counts()
        d = abs(c["share"] - target["share"])
        if best is None or d < best[0]:
            best = (d, s, c)
    assert best is not None  # the range holds at least one size
    return best[1], best[2], target
