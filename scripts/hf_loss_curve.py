"""The round trip HF checkpoint -> Go fine-tune -> from_pretrained -> generate, with the loss
curve of the Go trainer against torch's on the same weights, tokens and batches.

    .venv/bin/python scripts/hf_loss_curve.py [--steps 200] [--plot docs/go-loss-curve.png]

Nothing is downloaded. The text is a fixed set of Python standard-library modules (read from the
running interpreter); a byte-level BPE tokenizer is trained on it here and saved with an
OlmoeForCausalLM built from a config (torch.manual_seed(0)). scripts/tokenize_hf.py turns the
text into ids; the last 10% are held out. Then, from the same checkpoint:
- Go: `sonar-train --hf --sample sequential --log-every 1 --out DIR` (per-layer expert updates
  in backward, dense AdamW after clipping the dense gradients), one thread;
- torch: the same windows in the same order, the same LR schedule (linear warmup, cosine decay),
  `clip_grad_norm_` over the dense parameters, then `torch.optim.AdamW` over all, one thread.
The Go output directory is loaded with `AutoModelForCausalLM.from_pretrained` (warnings are
counted), evaluated on the held-out windows beside the torch-trained model, and generates text
from a prompt. Prints a markdown report (a table every --every steps) and writes the
plot.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM.from_pretrained returns (transformers annotates it so too), with
        generate as run calls it: without return_dict_in_generate it returns the token ids.
        (transformers types generate's self as a protocol that PreTrainedModel does not meet for mypy.)"""

        def generate(self, *args: Any, **kwargs: Any) -> torch.LongTensor: ...

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["argparse.py", "textwrap.py", "logging/__init__.py", "json/decoder.py", "json/encoder.py",
           "subprocess.py", "pathlib/_local.py", "dataclasses.py", "functools.py", "typing.py"]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def lr_at(step: int, peak: float, warmup: int, total: int, min_frac: float) -> float:
    """train.Schedule.LR: linear warmup to peak, then cosine decay to min_frac*peak at total."""
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    if total <= warmup:
        return peak
    p = min(1.0, (step - warmup) / (total - warmup))
    lo = peak * min_frac
    return lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * p))


def windows(ids: torch.Tensor, seq: int, first: int, count: int) -> torch.Tensor:
    """Windows first..first+count-1 of sonar-train's --sample sequential order, [count, seq+1]."""
    import torch

    n = (len(ids) - 1) // seq
    return torch.stack([ids[(i % n) * seq:(i % n) * seq + seq + 1] for i in range(first, first + count)])


def go_args(steps: int, batch: int, seq: int, lr: float, warmup: int, min_frac: float, weight_decay: float,
            max_grad_norm: float) -> list[str]:
    """sonar-train flags for train_torch's run: sequential windows, every step's loss printed."""
    return ["--steps", str(steps), "--batch", str(batch), "--seq-len", str(seq), "--lr", str(lr), "--warmup", str(warmup),
            "--min-lr-frac", str(min_frac), "--weight-decay", str(weight_decay), "--max-grad-norm", str(max_grad_norm),
            "--sample", "sequential", "--log-every", "1", "--held-out", "0", "--eval-batches", "0", "--progress", "off",
            "--log-level", "warn"]


def step_losses(stdout: str) -> list[float]:
    """Every step's loss from sonar-train --log-every 1 output (four decimals)."""
    return [float(m.group(1)) for m in re.finditer(r"^step +\d+/\d+ +loss ([0-9.]+) \(mean of +1 steps\)", stdout, re.M)]


def train_torch(model: torch.nn.Module, ids: torch.Tensor, steps: int, batch: int, seq: int, lr: float, warmup: int, min_frac: float,
                weight_decay: float, max_grad_norm: float) -> tuple[list[float], list[float]]:
    """What sonar-train --hf does with go_args, in torch: the same windows in the same order, the same
    LR schedule, clip_grad_norm_ over the dense (non-expert) parameters, then torch.optim.AdamW over all.
    The loss is the mean next-token cross-entropy over every position (no auxiliary loss). Returns
    every step's loss and time."""
    import torch

    model.train()
    dense = [p for n, p in model.named_parameters() if not is_expert(n)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, times = [], []
    for step in range(1, steps + 1):
        w = windows(ids, seq, (step - 1) * batch, batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup, steps, min_frac)
        t1 = time.perf_counter()
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dense, max_grad_norm)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t1)
        losses.append(loss.item())
    return losses, times


def is_expert(name: str) -> bool:
    """The batched expert tensors the Go trainer steps in backward (OLMoE, GraniteMoe)."""
    return ".experts." in name or ".input_linear." in name or ".output_linear." in name


def make_corpus(tmp: Path) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in MODULES:
        p = stdlib / name
        if p.exists():
            out = tmp / "text" / name.replace("/", "_")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
            files.append(out)
    if not files:
        raise SystemExit(f"no text found under {stdlib}")
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--every", type=int, default=20, help="table row every this many steps")
    ap.add_argument("--plot", type=Path, default=None, help="write the loss curves to this PNG")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="hf-loss-curve-"))
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> int:
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, OlmoeConfig, OlmoeForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    subprocess.run([str(ROOT / "scripts" / "build-go"), "-o", str(tmp), "sonar-train"], cwd=ROOT, check=True)

    # Tokenizer, checkpoint, token ids.
    files = make_corpus(tmp)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([str(f) for f in files], trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<unk>", "<pad>", "<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    cfg = OlmoeConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=max(256, args.seq), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    ck = tmp / "ck"
    OlmoeForCausalLM(cfg).save_pretrained(ck)
    tok.save_pretrained(ck)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tokenize_hf.py"), "--tokenizer", str(ck),
                    "--out", str(tmp / "all.safetensors"), *map(str, files)], check=True)
    ids = load_file(str(tmp / "all.safetensors"))["input_ids"]
    cut = int(len(ids) * 0.9)
    train_ids, held_ids = ids[:cut].clone(), ids[cut:].clone()
    save_file({"input_ids": train_ids}, str(tmp / "train.safetensors"))

    # Go.
    tuned = tmp / "tuned"
    cmd = [str(tmp / "sonar-train"), "--hf", str(ck), "--tokens", str(tmp / "train.safetensors"), "--out", str(tuned),
           "--procs", str(args.threads), *go_args(args.steps, args.batch, args.seq, args.lr, args.warmup, args.min_lr_frac,
                                                 args.weight_decay, args.max_grad_norm)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    go_wall = time.perf_counter() - t0
    go_loss = step_losses(res.stdout)
    assert len(go_loss) == args.steps, res.stdout
    row = re.search(r"\| per-layer[^|]*\|[^|]*\|[^|]*\|[^|]*\| ([0-9.]+) \| ([0-9.]+) \|", res.stdout)
    assert row is not None, res.stdout
    go_step_ms, go_cpu = float(row.group(1)), float(row.group(2))

    # torch, same weights, windows, schedule.
    model = AutoModelForCausalLM.from_pretrained(ck)
    c0 = cpu_s()
    torch_loss, times = train_torch(model, train_ids, args.steps, args.batch, args.seq, args.lr, args.warmup,
                                    args.min_lr_frac, args.weight_decay, args.max_grad_norm)
    torch_cpu = cpu_s() - c0

    # The Go checkpoint in transformers: load (counting warnings), evaluate, generate.
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    hf_logging.get_logger().addHandler(keep := Keep(level=logging.WARNING))
    # with output_loading_info=True, from_pretrained returns (model, info): its annotation says the model only
    go_model, info = cast("tuple[CausalLM, dict[str, Any]]",
                          AutoModelForCausalLM.from_pretrained(tuned, output_loading_info=True))
    hf_logging.get_logger().removeHandler(keep)
    bad_keys = {k: v for k, v in info.items() if v}
    tok2 = AutoTokenizer.from_pretrained(tuned)
    orig = AutoModelForCausalLM.from_pretrained(ck)
    held = windows(held_ids, args.seq, 0, (len(held_ids) - 1) // args.seq)

    def held_loss(m: torch.nn.Module) -> float:
        m.eval()
        with torch.no_grad():
            logits = m(input_ids=held[:, :-1]).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1)).item()

    h_orig, h_go, h_torch = held_loss(orig), held_loss(go_model), held_loss(model)
    prompt_ids = tok2("def ", return_tensors="pt")["input_ids"]
    gen = go_model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=40,
                            do_sample=False, pad_token_id=tok2.pad_token_id)

    diffs = [abs(a - b) for a, b in zip(go_loss, torch_loss)]
    last = min(10, args.steps)
    print(f"OLMoE 4 layers x 8 experts (top-2), hidden 128, intermediate 128, 4 heads, BPE vocab {len(tok)}; "
          f"{len(train_ids)} train / {len(held_ids)} held-out tokens ({len(files)} Python stdlib modules); "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens, lr {args.lr:g} (warmup {args.warmup}, cosine to "
          f"{args.min_lr_frac:g}x), weight decay {args.weight_decay:g}, dense clipping at {args.max_grad_norm:g}; "
          f"{args.threads} thread(s); torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}")
    print()
    print("| step | lr | Go loss | torch loss | Go - torch |")
    print("|---|---|---|---|---|")
    for s in sorted({1, *range(args.every, args.steps + 1, args.every)}):
        lr = lr_at(s, args.lr, args.warmup, args.steps, args.min_lr_frac)
        print(f"| {s} | {lr:.2e} | {go_loss[s - 1]:.4f} | {torch_loss[s - 1]:.4f} | {go_loss[s - 1] - torch_loss[s - 1]:+.4f} |")
    print()
    print(f"- |Go - torch| per step: mean {statistics.mean(diffs):.4f}, max {max(diffs):.4f}; mean of the last {last} "
          f"steps: Go {statistics.mean(go_loss[-last:]):.4f}, torch {statistics.mean(torch_loss[-last:]):.4f}")
    print(f"- held-out loss ({held.shape[0]} windows, transformers): before {h_orig:.5f}; after Go {h_go:.5f}; "
          f"after torch {h_torch:.5f}")
    print(f"- from_pretrained of the Go output: {len(records)} warning(s), loading info "
          f"{bad_keys if bad_keys else 'clean (no missing/unexpected/mismatched keys)'}")
    print(f"- step time: Go median {go_step_ms:.1f} ms ({go_cpu / args.steps:.3f} CPU s/step); torch median "
          f"{1000 * statistics.median(times):.1f} ms ({torch_cpu / args.steps:.3f} CPU s/step); Go run {go_wall:.1f} s wall")
    prompt = tok2.decode(prompt_ids[0])
    cont = tok2.decode(gen[0, prompt_ids.shape[1]:])
    print(f"- generate (greedy, Go-tuned model), prompt {prompt!r} -> {cont!r}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        steps = range(1, args.steps + 1)
        ax.plot(steps, torch_loss, label="torch AdamW (transformers OlmoeForCausalLM)", lw=1.2)
        ax.plot(steps, go_loss, label="Go sonar-train --hf (expert updates in backward)", lw=1.2, ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss ({args.batch} x {args.seq} tokens)")
        ax.set_title("OLMoE fine-tune, same checkpoint and batches")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot)
        print(f"- plot: {args.plot.relative_to(ROOT) if args.plot.is_absolute() and ROOT in args.plot.parents else args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
