"""Fine-tune the same small MoE twice: with torch.optim.AdamW and with SonarAdamW.

Run from the repository root:

    python examples/demo.py --steps 150              # a small Hugging Face OLMoE (default)
    python examples/demo.py --model tiny             # this repo's dependency-free TinyMoE

Both runs start from identical weights and see identical batches. The table at
the end compares held-out loss, median step time and the peak memory held by
expert gradients, and says whether the final parameters are bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES))
try:
    import sonar_moe
except ImportError:
    sys.path.insert(0, str(EXAMPLES.parent / "pyclient"))
    import sonar_moe

from tiny_moe import MoEConfig, batches, build, load_corpus, split_corpus

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    method: str
    held_out_loss: float
    median_step_ms: float
    peak_expert_grad_bytes: int


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The demo's model, from a config (random init: nothing is downloaded)."""
    dtype = DTYPES[args.dtype]
    if args.model == "tiny":
        cfg = MoEConfig(hidden=args.hidden, intermediate=3 * args.hidden // 2, num_layers=args.layers,
                        num_experts=args.experts, seq_len=args.seq_len, dtype=dtype)
        return build(cfg, args.seed)
    from transformers import OlmoeConfig, OlmoeForCausalLM

    hf_cfg = OlmoeConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         num_experts=args.experts, num_experts_per_tok=2,
                         max_position_embeddings=max(256, args.seq_len), pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(args.seed)
    model: torch.nn.Module = OlmoeForCausalLM(hf_cfg)
    return model.to(dtype)


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x)
    return out.loss if hasattr(out, "loss") else out[0]


def expert_param_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if sonar_moe.is_expert_param(n, p)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [lm_loss(model, x).item() for x in eval_batches]
    model.train()
    return sum(losses) / len(losses)


def train(
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_data: bytes,
    args: argparse.Namespace,
    before_step: Callable[[], None] = lambda: None,
) -> list[float]:
    """Run ``args.steps`` steps; return the step times in seconds.

    ``before_step`` runs between backward and ``optimizer.step()`` (it is timed).
    """
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_data, args.batch_size, args.seq_len, gen, count=args.steps)
    times: list[float] = []
    bar = tqdm(data, total=args.steps, desc=name, dynamic_ncols=True)
    for x in bar:
        start = time.perf_counter()
        loss = lm_loss(model, x)
        loss.backward()
        before_step()
        optimizer.step()
        times.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return times


def run_reference(
    train_data: bytes, eval_batches: list[torch.Tensor], args: argparse.Namespace
) -> tuple[Result, torch.nn.Module]:
    model = build_model(args)
    experts = set(expert_param_names(model))
    dense = [p for n, p in model.named_parameters() if n not in experts]
    expert_params = [p for n, p in model.named_parameters() if n in experts]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    peak = 0

    def clip_and_measure() -> None:
        nonlocal peak
        torch.nn.utils.clip_grad_norm_(dense, args.max_grad_norm)
        peak = max(peak, sum(p.grad.nbytes for p in expert_params if p.grad is not None))

    times = train("torch AdamW", model, opt, train_data, args, clip_and_measure)
    result = Result(
        "torch.optim.AdamW", evaluate(model, eval_batches), 1e3 * statistics.median(times), peak
    )
    return result, model


def run_sonar(
    train_data: bytes, eval_batches: list[torch.Tensor], args: argparse.Namespace
) -> tuple[Result, torch.nn.Module]:
    model = build_model(args)
    opt = sonar_moe.SonarAdamW(
        model, lr=args.lr, max_grad_norm=args.max_grad_norm, weight_decay=0.01
    )
    try:
        times = train("SonarAdamW", model, opt, train_data, args)
        peak = int(opt.stats()["peak_expert_grad_bytes"])
    finally:
        opt.close()
    result = Result(
        "sonar_moe.SonarAdamW", evaluate(model, eval_batches), 1e3 * statistics.median(times), peak
    )
    return result, model


def print_table(results: list[Result]) -> None:
    header = ("method", "held-out loss", "median step ms", "peak expert-grad bytes")
    rows = [
        (r.method, f"{r.held_out_loss:.4f}", f"{r.median_step_ms:.1f}", human_bytes(r.peak_expert_grad_bytes))
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    line = lambda row: " | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    print(line(header))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["olmoe", "tiny"], default="olmoe")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=16)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    train_data, held_out = split_corpus(load_corpus())
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = list(batches(held_out, args.batch_size, args.seq_len, eval_gen, count=args.eval_batches))
    probe = build_model(args)
    n_params = sum(p.numel() for p in probe.parameters())
    n_expert = sum(p.numel() for n, p in probe.named_parameters() if sonar_moe.is_expert_param(n, p))
    del probe
    print(
        f"corpus: {len(train_data):,} train / {len(held_out):,} held-out bytes of Python stdlib sources; "
        f"model: {args.model}, {n_params:,} params ({100 * n_expert / n_params:.0f}% in experts), "
        f"{args.layers} layers x {args.experts} experts, {args.dtype}"
    )

    ref, ref_model = run_reference(train_data, eval_batches, args)
    sonar, sonar_model = run_sonar(train_data, eval_batches, args)

    print()
    print_table([ref, sonar])
    pairs = list(zip(ref_model.parameters(), sonar_model.parameters()))
    equal = all(torch.equal(a, b) for a, b in pairs)
    print(f"\nparams bitwise equal: {'yes' if equal else 'no'}")
    if not equal:
        diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        print(f"max abs param difference: {diff:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
