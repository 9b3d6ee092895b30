"""Fine-tune a small Hugging Face MoE (OLMoE or GraniteMoe) with SonarAdamW on real text.

Run from the repository root (after `make setup build`):

    python examples/hf_finetune.py                       # OLMoE, a plain training loop
    python examples/hf_finetune.py --model granite       # GraniteMoe
    python examples/hf_finetune.py --mode trainer        # transformers.Trainer via sonar_moe.hf.SonarTrainer

The model is built from a config with random weights (nothing is downloaded): byte-level
(vocab 256), batched `[E, 2I, H]` / `[E, H, I]` expert tensors, trained on windows of the
Python standard library's sources (shipped with every Python), with the last 10% held out.

`--mode manual` is the loop you would write yourself: SonarAdamW (expert tensors updated
during backward, dense parameters clipped to `--max-grad-norm` and stepped by AdamW), a
warmup-cosine schedule from transformers, gradient accumulation. `--mode trainer` hands the
same job to `SonarTrainer`, a drop-in `transformers.Trainer` that builds SonarAdamW from the
TrainingArguments. Both print the held-out loss before and after, and the peak bytes of expert
gradients alive at once next to what standard training holds until `optimizer.step()`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
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

from tiny_moe import batches, load_corpus, split_corpus

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small OLMoE or GraniteMoe from a config (random init), in training mode."""
    from transformers import AutoModelForCausalLM, GraniteMoeConfig, OlmoeConfig

    common = dict(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts_per_tok=args.top_k, max_position_embeddings=max(256, args.seq_len),
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg: OlmoeConfig | GraniteMoeConfig
    if args.model == "olmoe":
        cfg = OlmoeConfig(**common, num_experts=args.experts)
    else:
        cfg = GraniteMoeConfig(**common, num_local_experts=args.experts)
    torch.manual_seed(args.seed)
    # experts_implementation picks the experts forward (transformers v5): "grouped_mm" (one
    # grouped GEMM per projection), "eager" (a loop over experts) or "batched_mm".
    model = AutoModelForCausalLM.from_config(
        cfg, experts_implementation=args.experts_implementation, dtype=DTYPES[args.dtype])
    if model.config._experts_implementation != args.experts_implementation:  # transformers fell back
        raise SystemExit(f"transformers built {model.config._experts_implementation!r} experts, "
                         f"not {args.experts_implementation!r}")
    return model.train()


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_batches: list[torch.Tensor]) -> float:
    was_training = model.training
    model.eval()
    losses = [model(input_ids=x, labels=x).loss.float().item() for x in eval_batches]
    model.train(was_training)
    return sum(losses) / len(losses)


# ------------------------------------------------------------------------ manual loop
def train_manual(model: torch.nn.Module, train_data: bytes, args: argparse.Namespace) -> dict:
    from transformers import get_cosine_schedule_with_warmup

    k = args.grad_accum
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_data, args.batch_size, args.seq_len, gen)
    times: list[float] = []
    with sonar_moe.SonarAdamW(
        model, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, grad_accumulation_steps=k,
    ) as opt:
        sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=args.warmup, num_training_steps=args.steps)
        bar = tqdm(range(args.steps), desc="SonarAdamW", dynamic_ncols=True)
        for _ in bar:
            start = time.perf_counter()
            total = 0.0
            for _ in range(k):
                x = next(data)
                loss = model(input_ids=x, labels=x).loss / k
                loss.backward()  # expert tensors are updated here, their gradients freed
                total += loss.item()
            opt.step()  # waits for the expert updates, clips dense grads, steps dense AdamW
            opt.zero_grad(set_to_none=True)
            sched.step()
            times.append(time.perf_counter() - start)
            gn = opt.last_dense_grad_norm
            bar.set_postfix(loss=f"{total:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}",
                            **({"dense_gn": f"{gn.item():.2f}"} if gn is not None else {}))
        stats = opt.stats()
    stats["median_step_ms"] = 1e3 * statistics.median(times)
    return stats


# --------------------------------------------------------------------------- Trainer
class ByteWindows(torch.utils.data.Dataset):
    """``count`` fixed random windows of ``seq_len`` bytes, as {input_ids, labels}."""

    def __init__(self, data: bytes, seq_len: int, count: int, seed: int) -> None:
        self.buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq_len + 1, (count,), generator=gen)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        x = self.buf[s:s + self.seq_len].long()
        return {"input_ids": x, "labels": x.clone()}


def train_trainer(model: torch.nn.Module, train_data: bytes, args: argparse.Namespace) -> dict:
    from transformers import TrainingArguments

    from sonar_moe.hf import SonarTrainer, unwrap_sonar

    dataset = ByteWindows(train_data, args.seq_len, args.steps * args.batch_size * args.grad_accum, args.seed)
    with tempfile.TemporaryDirectory(prefix="sonar-hf-") as out:
        targs = TrainingArguments(
            output_dir=out, report_to=[], use_cpu=True, seed=args.seed,
            max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
            weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm or 0.0,
            lr_scheduler_type="cosine", warmup_steps=args.warmup,
            logging_steps=max(1, args.steps // 10), save_strategy="no", dataloader_num_workers=0,
        )
        # SonarTrainer builds SonarAdamW from targs (lr, betas, eps, weight decay,
        # max_grad_norm for the dense parameters, gradient_accumulation_steps) and logs
        # dense_grad_norm; everything else is transformers.Trainer.
        trainer = SonarTrainer(model=model, args=targs, train_dataset=dataset)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        opt = unwrap_sonar(trainer.optimizer)  # accelerate wraps the optimizer
        if opt is None:
            raise TypeError(f"SonarTrainer's optimizer is a {type(trainer.optimizer).__name__}, not SonarAdamW")
        stats = opt.stats()
        logged = [h["dense_grad_norm"] for h in trainer.state.log_history if "dense_grad_norm" in h]
        if logged:
            print(f"dense_grad_norm (logged): first {logged[0]:.3f}, last {logged[-1]:.3f}")
        opt.close()
    stats["median_step_ms"] = 1e3 * elapsed / args.steps  # mean, Trainer overheads included
    return stats


# ------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["manual", "trainer"], default="manual")
    p.add_argument("--model", choices=["olmoe", "granite"], default="olmoe")
    p.add_argument("--experts-implementation", choices=["grouped_mm", "eager", "batched_mm"], default="grouped_mm")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="dense-only clipping; 0 turns it off")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.max_grad_norm is not None and args.max_grad_norm <= 0:
        args.max_grad_norm = None
    if args.warmup >= args.steps:
        args.warmup = max(0, args.steps // 10)
    return args


def main() -> int:
    args = parse_args()
    train_data, held_out = split_corpus(load_corpus())
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = list(batches(held_out, args.batch_size, args.seq_len, eval_gen, count=args.eval_batches))

    model = build_model(args)
    named = list(model.named_parameters())
    experts = [(n, p) for n, p in named if sonar_moe.is_expert_param(n, p)]
    n_params = sum(p.numel() for _, p in named)
    n_expert = sum(p.numel() for _, p in experts)
    expert_grad_bytes = sum(p.numel() * p.element_size() for _, p in experts)
    print(f"corpus: {len(train_data):,} train / {len(held_out):,} held-out bytes of Python stdlib sources")
    print(f"model: {type(model).__name__} ({args.experts_implementation}), {args.dtype}, "
          f"{args.layers} layers x {args.experts} experts (top-{args.top_k}), {n_params:,} params, "
          f"{100 * n_expert / n_params:.0f}% in {len(experts)} expert tensors")
    before = evaluate(model, eval_batches)
    print(f"held-out loss before: {before:.4f} (uniform over bytes: {math.log(256):.4f})")

    stats = (train_manual if args.mode == "manual" else train_trainer)(model, train_data, args)

    after = evaluate(model, eval_batches)
    print(f"held-out loss after {args.steps} steps ({args.mode}): {after:.4f}")
    print(f"peak expert-gradient bytes alive: {human_bytes(stats['peak_expert_grad_bytes'])} "
          f"(standard training holds all {human_bytes(expert_grad_bytes)} until optimizer.step())")
    print(f"step time: {stats['median_step_ms']:.1f} ms; server round trip p50 {stats['latency_ms_p50']:.2f} ms, "
          f"{stats['step_requests']} requests, server errors {stats.get('server', {}).get('errors', 'n/a')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
