"""Where a training step's time goes, phase by phase: forward, backward (with Sonar, the
expert updates happen in it) and the optimizer step, wall time and the trainer's CPU time
(all its threads) per phase, for torch's AdamW and SonarAdamW trained side by side on the same
batches (one step of each in turn). Sonar's private sonard's CPU time is reported per step
beside it, and sonard's own split of its update time (page check, gradient read, arithmetic).

It answers what train.py's step totals cannot: whether a slower step spends more CPU (work
added somewhere) or waits (the trainer's cores idle while sonard answers).

    python bench/phases.py --model granite --methods bq --steps 30

Methods: those of bench/train.py (the same keys, built by its Method): e.g. b torch.optim.AdamW
without clipping; q SonarAdamW without clipping (the same updates as b, bit for bit); d
SonarAdamW(max_grad_norm=1.0); c optimizer-in-backward over all parameters. Prints one JSON
document; --table prints a Markdown table instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import time
from typing import Any

import common
import torch
import transformers

import models
import tiny_moe
import train

PHASES = ("forward", "backward", "step")


class Trainee:
    """One of bench/train.py's methods (the same optimizer, options and environment); the
    per-phase times of its timed steps."""

    def __init__(self, key: str, model: torch.nn.Module) -> None:
        self.method = train.Method(key, model)
        self.wall: dict[str, list[float]] = {k: [] for k in PHASES}
        self.cpu: dict[str, list[float]] = {k: [] for k in PHASES}
        self.faults: list[int] = []
        self.server_cpu: list[float] = []

    def step(self, batch: dict[str, torch.Tensor], record: bool) -> None:
        m = self.method
        marks = [(time.perf_counter(), time.process_time())]
        f0, s0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, m.server_cpu()
        loss = m.model(**batch).loss
        marks.append((time.perf_counter(), time.process_time()))
        loss.backward()
        marks.append((time.perf_counter(), time.process_time()))
        m.update()
        marks.append((time.perf_counter(), time.process_time()))
        if not record:
            return
        for i, k in enumerate(PHASES):
            self.wall[k].append(marks[i + 1][0] - marks[i][0])
            self.cpu[k].append(marks[i + 1][1] - marks[i][1])
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        self.server_cpu.append(m.server_cpu() - s0)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "wall_ms": {k: 1e3 * common.median(v) for k, v in self.wall.items()},
            "cpu_ms": {k: 1e3 * common.median(v) for k, v in self.cpu.items()},
            "minor_faults": common.median([float(x) for x in self.faults]),
            # a mean: sonard's CPU time has clock-tick (10 ms) resolution
            "server_cpu_ms": 1e3 * sum(self.server_cpu) / max(len(self.server_cpu), 1),
        }
        out["wall_ms"]["total"] = 1e3 * common.median([sum(x) for x in zip(*self.wall.values())])
        out["cpu_ms"]["total"] = 1e3 * common.median([sum(x) for x in zip(*self.cpu.values())])
        if self.method.sonar is not None:
            srv = self.method.sonar.stats()["server"]
            out["server_phase_s"] = {k: float(srv.get(f"{k}_s", 0.0)) for k in ("check", "read", "kernel")}
        return out

    def close(self) -> None:
        self.method.close()


def table(res: dict[str, Any]) -> str:
    """The medians as a Markdown table, one row per method."""
    head = ("| method | forward ms | backward ms | step ms | total ms | CPU ms: forward / backward / step | "
            "sonard CPU ms | minor faults |")
    lines = [head, "|" + "---|" * 8]
    for key, r in res["methods"].items():
        w, c = r["wall_ms"], r["cpu_ms"]
        lines.append(f"| ({key}) | {w['forward']:.1f} | {w['backward']:.1f} | {w['step']:.1f} | {w['total']:.1f} | "
                     f"{c['forward']:.1f} / {c['backward']:.1f} / {c['step']:.1f} | {r['server_cpu_ms']:.1f} | "
                     f"{r['minor_faults']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("olmoe", "granite"), default="granite")
    ap.add_argument("--impl", default="grouped_mm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--methods", default="bq")
    ap.add_argument("--table", action="store_true", help="print a Markdown table instead of JSON")
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    shape, small, _ = models.small_shape(a.model, a.hidden, a.layers)
    data = tiny_moe.load_corpus(400_000)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": x, "labels": x}
               for x in tiny_moe.batches(data, a.batch, a.seq, gen, count=a.warmup + a.steps)]
    base = shape.build(a.impl, torch.float32, 0)
    state = copy.deepcopy(base.state_dict())
    trainees = []
    for key in a.methods:
        m = shape.build(a.impl, torch.float32, 0)
        m.load_state_dict(state)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
        trainees.append(Trainee(key, m))
    print(f"  {a.model}/{a.impl}: {small['total'] / 1e6:.2f} M params, methods {a.methods}", file=sys.stderr)
    for i, batch in enumerate(batches):
        for t in trainees:
            t.step(batch, record=i >= a.warmup)
    res = {"model": a.model, "impl": a.impl, "layers": a.layers, "steps": a.steps,
           "threads": torch.get_num_threads(), "methods": {t.method.key: t.result() for t in trainees}}
    for t in trainees:
        t.close()
    print(table(res) if a.table else json.dumps(res))


if __name__ == "__main__":
    main()
