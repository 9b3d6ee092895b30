"""A tiny byte-level Mixture-of-Experts language model (torch only).

Used by the tests and by ``examples/demo.py``. Two expert layouts are supported:

* ``"batched"``: one ``experts`` module holding 3D parameters
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (like HF transformers
  v5 OLMoE). Every expert slice takes part in every forward, so both tensors
  always receive a gradient.
* ``"modulelist"``: ``experts`` is an ``nn.ModuleList`` of E small MLPs with
  ``gate_up`` and ``down`` ``nn.Linear`` layers. Experts that receive no token
  are skipped, so their parameters get no gradient in that step.

Data helpers read real text that ships with every Python install: the standard
library's ``.py`` sources.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEConfig:
    vocab: int = 256
    hidden: int = 64
    intermediate: int = 96
    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    seq_len: int = 64
    num_heads: int = 2
    layout: str = "batched"  # "batched" or "modulelist"
    dtype: torch.dtype = torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        assert cfg.hidden % cfg.num_heads == 0
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class BatchedExperts(nn.Module):
    """All experts in two 3D parameters (HF transformers v5 style)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_proj[e].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[e].T

    def forward(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert over its tokens (one call a layer, as transformers' experts modules: FSDP2
        can then shard this module as a group of its own)."""
        out = torch.zeros_like(flat)
        for e in range(self.gate_up_proj.shape[0]):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            # Runs even with zero tokens: the 3D tensors always get a grad.
            out = out.index_add(0, tok, self.expert(e, flat[tok]) * weights[tok, slot, None])
        return out


class ExpertMLP(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        if cfg.layout not in ("batched", "modulelist"):
            raise ValueError(f"unknown expert layout {cfg.layout!r}")
        self.layout = cfg.layout
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts: nn.Module
        if cfg.layout == "batched":
            self.experts = BatchedExperts(cfg)
        else:
            self.experts = nn.ModuleList(ExpertMLP(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)

        if isinstance(self.experts, BatchedExperts):
            return self.experts(flat, chosen, weights).view(shape)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self.experts[e](flat[tok])  # type: ignore[index]
            out = out.index_add(0, tok, y * weights[tok, slot, None])
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class TinyMoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Drawn before any submodule consumes the global RNG, so init depends
        # only on torch.manual_seed, not on the expert layout.
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self._init_weights(init_seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Batched expert tensors are filled one expert slice at a time, in the
        # same order as the per-expert Linears, so both layouts get the same
        # weights for the same seed.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("experts.gate_up_proj"):
                experts = self.get_submodule(name.rsplit(".", 1)[0])
                assert isinstance(experts, BatchedExperts)
                for gate_up, down in zip(experts.gate_up_proj, experts.down_proj):
                    gate_up.normal_(0.0, 0.02, generator=g)
                    down.normal_(0.0, 0.02, generator=g)
            elif not name.endswith("experts.down_proj"):  # down_proj: done above
                p.normal_(0.0, 0.02, generator=g)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [B, T] -> logits [B, T, vocab].

        With ``labels`` (usually ``labels = input_ids``) returns
        ``(loss, logits)``; the shift for next-byte prediction happens here.
        """
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids) + self.pos_embed(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            labels[:, 1:].reshape(-1),
        )
        return loss, logits


def build(cfg: MoEConfig, seed: int) -> TinyMoE:
    """Seed torch's RNG, construct the model in float32, then cast to ``cfg.dtype``.

    The same ``(cfg, seed)`` always gives bitwise identical weights.
    """
    torch.manual_seed(seed)
    return TinyMoE(cfg).to(cfg.dtype)


def expert_param_names(model: nn.Module) -> list[str]:
    """Names of all expert parameters (anything under a module named ``experts``)."""
    return [n for n, _ in model.named_parameters() if ".experts." in f".{n}"]


def load_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``.py`` sources.

    Files are visited in sorted path order (site-/dist-packages skipped), so the
    result is deterministic for a given Python install.
    """
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fname), "rb") as f:
                    text = f.read(max_bytes - total)
            except OSError:
                continue
            chunks.append(text)
            total += len(text)
            if total >= max_bytes:
                return b"".join(chunks)
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root}")
    return b"".join(chunks)


def split_corpus(data: bytes, held_out_fraction: float = 0.1) -> tuple[bytes, bytes]:
    """Split into (train, held_out); the held-out part is the tail of ``data``."""
    cut = int(len(data) * (1.0 - held_out_fraction))
    return data[:cut], data[cut:]


def batches(
    data: bytes,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    count: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield random windows of ``data`` as LongTensor [batch_size, seq_len].

    Use a window as both inputs and labels: ``model(x, labels=x)`` (the model
    shifts internally). Infinite unless ``count`` is given. Deterministic for a
    given ``generator`` state.
    """
    if len(data) < seq_len:
        raise ValueError(f"need at least {seq_len} bytes, got {len(data)}")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offsets = torch.arange(seq_len)
    n = 0
    while count is None or n < count:
        starts = torch.randint(0, len(data) - seq_len + 1, (batch_size, 1), generator=generator)
        yield buf[starts + offsets].long()
        n += 1
