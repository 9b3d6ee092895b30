"""Training speed of the Go OLMoE (sonar-train --hf) against torch on CPU, same config and threads.

    .venv/bin/python bench/olmoe_go_vs_torch.py [--threads 1 2] [--steps 20]

Builds an OlmoeForCausalLM from a config (nothing is downloaded), saves it, and trains it for
--steps steps on random token ids, batch x seq tokens a step, lr 1e-3, dense-only clipping at 1:
- torch: fp32, `clip_grad_norm_` over the dense parameters then `torch.optim.AdamW` over all,
  `torch.set_num_threads(T)`, for each attention/experts implementation in --torch-impls;
- Go: `sonar-train --hf --procs T` (per-layer run only; expert updates in backward, dense AdamW).
--torch-bf16 adds torch rows with bfloat16 weights (and AdamW states). --repeats R runs every row
R times, interleaved, and reports medians over the runs. Prints a markdown table: median step ms,
tokens/s from the median step, CPU seconds per step (process user+system time; on a shared
machine it is the steadier figure).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def torch_run(ck: Path, ids: torch.Tensor, batch: int, seq: int, steps: int, threads: int, impl: str,
              bf16: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    attn, experts = impl.split("/")
    model = AutoModelForCausalLM.from_pretrained(ck, attn_implementation=attn, experts_implementation=experts,
                                                 dtype=torch.bfloat16 if bf16 else torch.float32)
    model.train()
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    times, cpus = [], []
    for step in range(steps + 3):
        off = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[o:o + seq] for o in off.tolist()])
        t0, c0 = time.perf_counter(), cpu_s()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dense, 1.0)
        opt.step()
        opt.zero_grad()
        if step >= 3:  # warm-up steps not timed
            times.append(time.perf_counter() - t0)
            cpus.append(cpu_s() - c0)
    return {"median_ms": 1000 * statistics.median(times), "cpu_s": statistics.mean(cpus)}


def go_run(binary: Path, ck: Path, ids_path: Path, batch: int, seq: int, steps: int, threads: int) -> dict:
    res = subprocess.run([str(binary), "--hf", str(ck), "--tokens", str(ids_path), "--steps", str(steps),
                          "--batch", str(batch), "--seq-len", str(seq), "--lr", "1e-3", "--warmup", "0",
                          "--procs", str(threads), "--eval-batches", "0", "--log-level", "warn",
                          "--progress", "off", "--held-out", "0"], check=True, capture_output=True, text=True)
    row = re.search(r"\| per-layer[^|]*\|[^|]*\|[^|]*\|[^|]*\| ([0-9.]+) \| ([0-9.]+) \|", res.stdout)
    assert row, res.stdout
    return {"median_ms": float(row.group(1)), "cpu_s": float(row.group(2)) / steps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--torch-impls", nargs="+", default=["sdpa/grouped_mm", "eager/eager"])
    ap.add_argument("--repeats", type=int, default=1, help="runs of every row (medians are reported)")
    ap.add_argument("--torch-bf16", action="store_true",
                    help="also time torch with bfloat16 weights (the Go trainer computes in float32 either way)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import OlmoeConfig, OlmoeForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="olmoe-bench-"))
    subprocess.run([str(ROOT / "scripts" / "build-go"), "-o", str(tmp), "sonar-train"], cwd=ROOT, check=True)
    cfg = OlmoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      num_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.seq,
                      pad_token_id=None, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    ck = tmp / "ck"
    OlmoeForCausalLM(cfg).save_pretrained(ck)
    ids = torch.randint(0, args.vocab, (200_000,), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, str(tmp / "ids.safetensors"))
    n = args.batch * args.seq
    print(f"OLMoE {args.layers} layers x {args.experts} experts (top-2), hidden {args.hidden}, intermediate "
          f"{args.intermediate}, vocab {args.vocab}; {args.batch} x {args.seq} tokens a step, {args.steps} timed steps; "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print()
    print("| trainer | threads | median step ms | tokens/s | CPU s / step |")
    print("|---|---|---|---|---|")
    for th in args.threads:
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            runs.setdefault("Go sonar-train --hf", []).append(
                go_run(tmp / "sonar-train", ck, tmp / "ids.safetensors", args.batch, args.seq, args.steps, th))
            for impl in args.torch_impls:
                for bf16 in [False, True] if args.torch_bf16 else [False]:
                    name = f"torch AdamW ({impl}{', bf16' if bf16 else ''})"
                    runs.setdefault(name, []).append(torch_run(ck, ids, args.batch, args.seq, args.steps, th, impl, bf16))
        for name, rs in runs.items():
            ms = statistics.median(r["median_ms"] for r in rs)
            cpu = statistics.median(r["cpu_s"] for r in rs)
            print(f"| {name} | {th} | {ms:.1f} | {n / ms * 1000:.0f} | {cpu:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
