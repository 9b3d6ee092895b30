"""Quality experiment: held-out loss of SonarAdamW against standard AdamW, over seeds.

Run from the repository root, with the venv and a built server (``make quality`` does both):

    scripts/build-go sonard
    SONARD=$PWD/bin/sonard .venv/bin/python scripts/quality.py

For each model (a small OLMoE and a small GraniteMoe built from configs, Hugging Face
transformers v5 batched expert tensors), each precision (float32, bfloat16: parameters,
gradients and optimizer states all in that dtype) and each seed (the seed picks the initial
weights and the order of the training batches; the held-out set is the same for all), it
fine-tunes one copy per method from the same initial weights on the same batches of
byte-level text (the Python standard library's sources, ``examples/tiny_moe.py``):

  global       ``torch.optim.AdamW`` + ``clip_grad_norm_(all params, c)``  (standard)
  noclip       ``torch.optim.AdamW`` without clipping
  sonar        ``SonarAdamW(max_grad_norm=c)``: the default; dense-only clipping, the expert
               tensors are updated during backward and never clipped
  prev_global  ``SonarAdamW(max_grad_norm=c, expert_clipping="prev_global")``
  running      ``SonarAdamW(max_grad_norm=c, expert_clipping="running")``
  dense        (control, not in the default grid) ``torch.optim.AdamW`` +
               ``clip_grad_norm_(dense params, c)``: sonar's documented reference

Every run is deterministic given its seed, so the methods of one seed form a pair: the
report gives each method's mean and standard deviation over seeds, and the mean paired
difference to global clipping with a 95% confidence interval (Student t over seeds).
Runs go to ``--jobs`` worker processes (one torch thread each); each finished run is
appended to ``--results`` (JSON lines), so ``--report-only`` can redo the report and plots,
and an interrupted grid keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CRITERION = 0.003
METHODS = {
    "global": "AdamW + global clipping",
    "noclip": "AdamW, no clipping",
    "sonar": "Sonar, dense-only clipping (default)",
    "prev_global": "Sonar, expert_clipping='prev_global'",
    "running": "Sonar, expert_clipping='running'",
    "dense": "control: AdamW + dense-only clipping",
}
SHORT = {"global": "global", "noclip": "no clip", "sonar": "Sonar default", "prev_global": "Sonar prev_global",
         "running": "Sonar running", "dense": "dense-only (torch)"}
SONAR_METHODS = ("sonar", "prev_global", "running")
MODELS = {"olmoe": "OLMoE", "granite": "GraniteMoe"}
DTYPES = ("float32", "bfloat16")
# Two-sided 95% Student t quantiles by degrees of freedom (df > 30: 1.96 is close enough).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 25: 2.060, 30: 2.042}
EVAL_SEED = 12345  # the held-out batches: the same for every seed and method


def t95(df: int) -> float:
    if df in T95:
        return T95[df]
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96


# ------------------------------------------------------------------------ one run
_CORPUS: tuple[bytes, bytes] | None = None


def _imports() -> None:
    for p in (REPO / "examples", REPO / "pyclient"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def make_model(kind: str, dtype: str, seed: int, a: dict[str, Any]) -> Any:
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=a["hidden"], intermediate_size=a["intermediate"],
                  num_hidden_layers=a["layers"], num_attention_heads=a["heads"], num_key_value_heads=a["heads"],
                  num_experts_per_tok=a["top_k"], max_position_embeddings=max(256, a["seq_len"]),
                  tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  output_router_logits=False)  # no router aux loss: the loss is plain next-byte CE
    cfg: transformers.PreTrainedConfig
    if kind == "olmoe":
        cfg = transformers.OlmoeConfig(num_experts=a["experts"], **common)
    else:
        cfg = transformers.GraniteMoeConfig(num_local_experts=a["experts"], **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(getattr(torch, dtype)).train()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (model, dtype, seed, method) and return what the report needs."""
    _imports()
    import torch
    import transformers

    import sonar_moe
    import tiny_moe

    global _CORPUS
    a = job["args"]
    torch.set_num_threads(a["threads"])
    if _CORPUS is None:
        _CORPUS = tiny_moe.split_corpus(tiny_moe.load_corpus())
    train_data, held_out = _CORPUS
    kind, dtype, seed, method = job["model"], job["dtype"], job["seed"], job["method"]
    c = a["max_grad_norm"]
    train = list(tiny_moe.batches(train_data, a["batch_size"], a["seq_len"],
                                  torch.Generator().manual_seed(seed), count=a["steps"]))
    evals = list(tiny_moe.batches(held_out, a["batch_size"], a["seq_len"],
                                  torch.Generator().manual_seed(EVAL_SEED), count=a["eval_batches"]))
    model = make_model(kind, dtype, seed, a)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    dense = [p for n, p in named if not sonar_moe.is_expert_param(n, p)]

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = [float(model(input_ids=x, labels=x, use_cache=False).loss) for x in evals]
        model.train()
        return sum(losses) / len(losses)

    def total_norm(ps: list[torch.nn.Parameter]) -> float:
        grads = [p.grad for p in ps if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    sonar_opt: sonar_moe.SonarAdamW | None = None  # set for the SONAR_METHODS
    if method in SONAR_METHODS:
        sonar_opt = sonar_moe.SonarAdamW(
            model, lr=a["lr"], weight_decay=a["weight_decay"], max_grad_norm=c,
            expert_clipping=None if method == "sonar" else method)
        opt: torch.optim.Optimizer = sonar_opt
        n_expert = int(sonar_opt.stats()["expert_tensors"])
    else:
        opt = torch.optim.AdamW(params, lr=a["lr"], weight_decay=a["weight_decay"])
        n_expert = len(params) - len(dense)
    if n_expert != 2 * a["layers"]:
        raise SystemExit(f"{kind}: {n_expert} expert tensors, want {2 * a['layers']}")
    sched = transformers.get_cosine_schedule_with_warmup(opt, int(a["warmup_frac"] * a["steps"]), a["steps"])
    curve = [(0, evaluate())]
    norms: list[float] = []  # the global norm of each step (what global clipping compares with c)
    scales: list[float] = []  # the factor the expert gradients got
    exact: list[float] = []  # the factor global clipping would have given them
    start = time.perf_counter()
    try:
        for step, x in enumerate(train, 1):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            if method == "global":
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, c)))
                scales.append(min(1.0, c / (norms[-1] + 1e-6)))
            elif method == "noclip":
                norms.append(total_norm(params))
                scales.append(1.0)
            elif method == "dense":
                norms.append(math.nan)
                torch.nn.utils.clip_grad_norm_(dense, c)
                scales.append(1.0)
            opt.step()
            if method in ("prev_global", "running"):
                assert sonar_opt is not None
                # with expert_clipping, both are set by the step just taken
                global_norm, expert_scale = sonar_opt.last_global_grad_norm, sonar_opt.last_expert_grad_scale
                assert global_norm is not None and expert_scale is not None
                norms.append(float(global_norm))
                scales.append(float(expert_scale))
            elif method == "sonar":
                norms.append(math.nan)  # the expert norms are never computed
                scales.append(1.0)
            exact.append(min(1.0, c / (norms[-1] + 1e-6)) if math.isfinite(norms[-1]) else math.nan)
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % a["eval_every"] == 0 or step == a["steps"]:
                curve.append((step, evaluate()))
    finally:
        if method in SONAR_METHODS:
            assert sonar_opt is not None
            sonar_opt.close()
    return {"model": kind, "dtype": dtype, "seed": seed, "method": method, "final": curve[-1][1], "curve": curve,
            "norms": norms, "scales": scales, "exact": exact, "seconds": time.perf_counter() - start,
            "params": sum(p.numel() for p in params),
            "expert_params": sum(p.numel() for n, p in named if sonar_moe.is_expert_param(n, p)),
            "config": {k: a[k] for k in sorted(a)}}


def _worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------------ statistics
def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean, standard deviation and 95% CI half-width (Student t) of xs."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    sd = statistics.stdev(xs)
    return m, sd, t95(len(xs) - 1) * sd / math.sqrt(len(xs))


def index(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]]:
    out: dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]] = {}
    for r in rows:
        out.setdefault((r["model"], r["dtype"]), {}).setdefault(r["method"], {})[r["seed"]] = r
    return out


def paired(by_m: dict[str, dict[int, dict[str, Any]]], m: str, base: str) -> list[float]:
    seeds = sorted(set(by_m.get(m, {})) & set(by_m.get(base, {})))
    return [by_m[m][s]["final"] - by_m[base][s]["final"] for s in seeds]


def verdict(d: list[float]) -> str:
    if len(d) < 2:
        return "n/a"
    m, _, h = mean_ci(d)
    if abs(m) + h <= CRITERION:
        return "within"
    if abs(m) - h > CRITERION:
        return "outside"
    return "undecided"


# ------------------------------------------------------------------------ plots
def plot(rows: list[dict[str, Any]], curves_png: Path, diffs_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = index(rows)
    keys = [(k, d) for k in MODELS for d in DTYPES if (k, d) in idx]
    if not keys:
        return
    colors = {"global": "black", "noclip": "tab:gray", "sonar": "tab:blue", "prev_global": "tab:orange",
              "running": "tab:green", "dense": "tab:purple"}
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for m, by_seed in idx[key].items():
            runs = list(by_seed.values())
            steps = [s for s, _ in runs[0]["curve"]][1:]
            mean = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(1, len(steps) + 1)]
            sd = [statistics.pstdev([r["curve"][i][1] for r in runs]) for i in range(1, len(steps) + 1)]
            ax.plot(steps, mean, label=f"{SHORT[m]} (n={len(runs)})", color=colors[m], lw=1.3)
            ax.fill_between(steps, [a - b for a, b in zip(mean, sd)], [a + b for a, b in zip(mean, sd)],
                            color=colors[m], alpha=0.12)
        finals = [r["final"] for by in idx[key].values() for r in by.values()]
        ax.set_ylim(min(finals) - 0.05, min(finals) + 0.6)
        ax.set_title(f"{MODELS[key[0]]}, {key[1]}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out loss (nats/byte), mean ± sd over seeds")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        by_m = idx[key]
        if "global" not in by_m:
            continue
        for m in by_m:
            if m == "global":
                continue
            seeds = sorted(set(by_m[m]) & set(by_m["global"]))
            if len(seeds) < 2:
                continue
            n_pts = len(by_m[m][seeds[0]]["curve"])
            steps = [s for s, _ in by_m[m][seeds[0]]["curve"]][1:]
            lo, mid, hi = [], [], []
            for i in range(1, n_pts):
                d = [by_m[m][s]["curve"][i][1] - by_m["global"][s]["curve"][i][1] for s in seeds]
                mm, _, h = mean_ci(d)
                lo.append(mm - h)
                mid.append(mm)
                hi.append(mm + h)
            ax.plot(steps, mid, color=colors[m], label=SHORT[m], lw=1.3)
            ax.fill_between(steps, lo, hi, color=colors[m], alpha=0.15)
        ax.axhspan(-CRITERION, CRITERION, color="gold", alpha=0.25, label=f"±{CRITERION}")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylim(-0.06, 0.12)
        ax.set_title(f"{MODELS[key[0]]}, {key[1]}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out loss minus global clipping's\n(paired by seed; band: 95% CI)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(diffs_png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ report
def machine() -> str:
    import torch
    import transformers

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{len(os.sched_getaffinity(0))} CPU cores ({cpu}, torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, transformers "
            f"{transformers.__version__}, Python {platform.python_version()}")


def git_revision() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (" plus uncommitted changes" if dirty else "")


def fmt_ci(d: list[float]) -> str:
    if not d:
        return "-"
    m, _, h = mean_ci(d)
    if math.isnan(h):
        return f"{m:+.4f}"
    return f"{m:+.4f} [{m - h:+.4f}, {m + h:+.4f}]"


def write_report(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    idx = index(rows)
    a = rows[0]["config"]
    out: list[str] = []
    w = out.append
    w("# Quality: held-out loss of SonarAdamW against AdamW baselines, over seeds")
    w("")
    w(f"The Sonar-MoE paper claims held-out loss **within {CRITERION} of every baseline** (bf16). This report")
    w("measures it on small Hugging Face MoE models on CPU, in float32 and bfloat16, over several seeds,")
    w("for Sonar's default (dense-only clipping) and for its two expert-clipping modes. It is generated by")
    w("`scripts/quality.py` (`make quality`); the raw runs are in `docs/quality-results.jsonl`.")
    w("")
    w("## Setup")
    w("")
    w(f"- Date (UTC): {meta['date']}; code: {meta['revision']}")
    w(f"- Machine: {meta['machine']}")
    w("- Command (from the repository root, after `scripts/build-go sonard`):")
    w("")
    w("  ```sh")
    w(f"  {meta['command']}")
    w("  ```")
    w("")
    w(f"- Runtime: {meta['wall']}")
    seeds = sorted({r["seed"] for r in rows})
    n = {k: (r["params"], r["expert_params"]) for r in rows for k in [r["model"]]}
    w(f"- Models (random init from a config): {a['layers']} layers (the benchmark's depth, `make bench`),"
      f" hidden {a['hidden']}, {a['heads']} heads, {a['experts']} experts of intermediate size"
      f" {a['intermediate']}, top-{a['top_k']}, no router auxiliary loss; "
      + "; ".join(f"{MODELS[k]}: {v[0]:,} parameters, {v[1]:,} in batched expert tensors"
                  for k, v in n.items()) + ".")
    w(f"- Precision: float32, and bfloat16 for parameters, gradients and optimizer states alike (pure bf16,"
      " as Sonar's bf16 expert tensors are; the loss itself is computed in float32 by transformers).")
    w(f"- Seeds: {', '.join(map(str, seeds))}. A seed picks the initial weights and the training batches"
      " (random windows); all methods of one seed start from the same weights and see the same batches,"
      " so they are compared in pairs.")
    w(f"- Data: byte-level Python standard-library sources (`tiny_moe.load_corpus()`), 90% / 10% train /"
      f" held-out. Batches of {a['batch_size']} x {a['seq_len']} bytes. Held-out loss: mean next-byte"
      f" cross-entropy (nats) over the same {a['eval_batches']} held-out batches for every run, every"
      f" {a['eval_every']} steps.")
    w(f"- Optimisation: {a['steps']} steps, AdamW lr {a['lr']:g}, betas (0.9, 0.999), eps 1e-8, weight decay"
      f" {a['weight_decay']:g}, `get_cosine_schedule_with_warmup` ({a['warmup_frac']:.0%} warmup), clipping"
      f" threshold c = {a['max_grad_norm']:g}.")
    w("")
    w("Methods:")
    w("")
    w("- **global**: `torch.optim.AdamW` + `clip_grad_norm_(model.parameters(), c)` (the standard).")
    w("- **no clip**: `torch.optim.AdamW` without clipping.")
    w("- **Sonar default**: `SonarAdamW(model, max_grad_norm=c)`: experts updated during backward, never"
      " clipped; dense gradients clipped by their own norm. Bitwise equal to `torch.optim.AdamW` +"
      " `clip_grad_norm_(dense_params, c)` (tests, and the control run of the previous report).")
    w("- **Sonar prev_global** / **Sonar running**: `SonarAdamW(model, max_grad_norm=c,"
      " expert_clipping=...)`. The server measures each expert gradient's norm in the pass that applies it;"
      " at `step()` the client adds the dense norm, which gives the step's global norm G_t exactly as"
      " global clipping computes it (up to summation order), and clips the dense gradients by G_t as global"
      " clipping would. The expert gradients of step t+1 are multiplied on the server by"
      " min(1, c / (E_t + 1e-6)), with E_t = G_t (`prev_global`) or a bias-corrected moving average of"
      " G_1..G_t with decay 0.9 (`running`). Step 1 has no estimate and is not scaled.")
    w("")
    w("## Results")
    w("")
    w("Held-out loss after the last step, mean ± sample standard deviation over seeds; paired difference"
      " to global clipping (method minus global, per seed), mean and 95% confidence interval (Student t).")
    w(f"\"within {CRITERION}\": the whole CI lies inside ±{CRITERION}; \"outside\": the whole CI lies beyond it;"
      " \"undecided\": neither.")
    w("")
    w("![held-out loss curves](quality-curves.png)")
    w("")
    w("![difference to global clipping](quality-diffs.png)")
    w("")
    summary: list[tuple[str, str, str, list[float]]] = []
    for kind in MODELS:
        for dt in DTYPES:
            by_m = idx.get((kind, dt))
            if not by_m:
                continue
            w(f"### {MODELS[kind]}, {dt}")
            w("")
            w(f"| method | n | held-out loss | − global: mean [95% CI] | max \\|diff\\| | − no clip: mean [95% CI] |"
              " within 0.003 of global? | loss change, last 20% of steps | expert factor vs global's |")
            w("|---|---|---|---|---|---|---|---|---|")
            for m in METHODS:
                if m not in by_m:
                    continue
                runs = list(by_m[m].values())
                mm, sd, _ = mean_ci([r["final"] for r in runs])
                d_g = paired(by_m, m, "global") if m != "global" else []
                d_n = paired(by_m, m, "noclip") if m != "noclip" else []
                flat = []
                for r in runs:
                    cut = [v for s, v in r["curve"] if s <= 0.8 * a["steps"]][-1]
                    flat.append(r["final"] - cut)
                factor = "-"
                if m in ("prev_global", "running"):
                    ratios = [s / e for r in runs for s, e in zip(r["scales"], r["exact"])
                              if math.isfinite(e) and (s < 1 or e < 1)]
                    if ratios:
                        ratios.sort()
                        factor = (f"median {statistics.median(ratios):.3f}, 10-90% {ratios[len(ratios) // 10]:.2f}-"
                                  f"{ratios[(9 * len(ratios)) // 10]:.2f}")
                elif m in ("global", "noclip"):
                    clipped = [e for r in runs for e in r["exact"] if math.isfinite(e)]
                    factor = (f"global norm > c on {sum(1 for e in clipped if e < 1) / max(1, len(clipped)):.0%}"
                              " of steps")
                v = verdict(d_g) if d_g else "-"
                if d_g:
                    summary.append((kind, dt, m, d_g))
                mx = f"{max(abs(x) for x in d_g):.4f}" if d_g else "-"
                w(f"| {SHORT[m]} | {len(runs)} | {mm:.4f} ± {sd:.4f} | {fmt_ci(d_g)} |"
                  f" {mx} | {fmt_ci(d_n)} | {v} |"
                  f" {statistics.fmean(flat):+.4f} | {factor} |")
            w("")
    w("\"expert factor vs global's\": over the steps where either clips, the factor a mode gave the expert")
    w("gradients divided by the factor global clipping would have given them at that step (1 = the same).")
    w("\"loss change, last 20%\": the held-out loss at the end minus at 80% of the steps (mean over seeds);")
    w("near 0 means the curve has flattened.")
    w("")
    w("## Verdict")
    w("")
    for m in ("sonar", "prev_global", "running", "noclip"):
        ds = [(k, d, x) for k, d, mm, x in summary if mm == m]
        if not ds:
            continue
        parts = [f"{MODELS[k]} {d} {fmt_ci(x)} ({verdict(x)})" for k, d, x in ds]
        w(f"- **{SHORT[m]}** − global: " + "; ".join(parts) + ".")
    w("")
    base_gap = [(k, d, x) for k, d, mm, x in summary if mm == "noclip"]
    if base_gap:
        w("The two baselines themselves (no clip − global): "
          + "; ".join(f"{MODELS[k]} {d} {fmt_ci(x)}" for k, d, x in base_gap)
          + f". Where they are more than {2 * CRITERION} apart, no optimizer can be within {CRITERION} of both,"
          " so \"within 0.003 of every baseline\" is judged here against global clipping, the baseline"
          " a user would otherwise run.")
        w("")
    for m in ("sonar", "prev_global", "running"):
        ds = [(k, d, x) for k, d, mm, x in summary if mm == m]
        if not ds:
            continue
        vs = [verdict(x) for _, _, x in ds]
        if all(v == "within" for v in vs):
            w(f"- {SHORT[m]}: within {CRITERION} of global clipping in all {len(ds)} configurations, with 95%"
              " confidence.")
        else:
            w(f"- {SHORT[m]}: within {CRITERION} of global clipping with 95% confidence in"
              f" {sum(v == 'within' for v in vs)} of {len(ds)} configurations, outside it in"
              f" {sum(v == 'outside' for v in vs)}, undecided in {sum(v == 'undecided' for v in vs)}; the largest"
              f" mean gap is {max(abs(statistics.fmean(x)) for _, _, x in ds):.4f}.")
    w("")
    notes = meta.get("notes")
    if notes:
        w("## Notes on this run")
        w("")
        w(notes)
        w("")
    text = "\n".join(out)
    path.write_text(text)
    return text


# ------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    p.add_argument("--models", default="olmoe,granite")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default="global,noclip,sonar,prev_global,running",
                   help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-frac", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (runs in parallel)")
    p.add_argument("--results", default="docs/quality-results.jsonl", help="JSON lines, one per finished run")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --results, run the rest")
    p.add_argument("--report-only", action="store_true", help="redo the report and plots from --results")
    p.add_argument("--out", default="docs/quality.md", help="Markdown report ('' to skip)")
    args = p.parse_args()
    if args.steps < 1 or args.eval_batches < 1 or args.eval_every < 1 or args.jobs < 1:
        p.error("--steps, --eval-batches, --eval-every and --jobs must be positive")
    for m in args.methods.split(","):
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    for k in args.models.split(","):
        if k not in MODELS:
            p.error(f"unknown model {k!r}; choose from {', '.join(MODELS)}")
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    return args


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def main() -> int:
    args = parse_args()
    results = Path(args.results)
    config = {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "hidden", "intermediate", "layers",
                                            "experts", "top_k", "heads", "lr", "weight_decay", "warmup_frac",
                                            "max_grad_norm", "eval_batches", "eval_every", "threads")}
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    if not args.report_only:
        rows = load_rows(results) if args.resume else []
        if not args.resume:
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text("")
        done = {(r["model"], r["dtype"], r["seed"], r["method"]) for r in rows}
        # Seed by seed (an interrupted grid leaves whole seeds), bfloat16 (slow) first within each.
        jobs = [{"model": k, "dtype": d, "seed": int(s), "method": m, "args": config}
                for s in args.seeds.split(",") for d in reversed(args.dtypes.split(","))
                for k in args.models.split(",") for m in args.methods.split(",")
                if (k, d, int(s), m) not in done]
        print(f"{len(jobs)} runs on {args.jobs} workers", flush=True)
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.jobs, initializer=_worker_init) as pool, results.open("a") as f:
            for i, r in enumerate(pool.imap_unordered(run_job, jobs), 1):
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"[{i}/{len(jobs)} {time.perf_counter() - t0:.0f} s] {r['model']}/{r['dtype']}/seed {r['seed']}/"
                      f"{r['method']}: held-out {r['final']:.4f} ({r['seconds']:.0f} s)", flush=True)
    rows = load_rows(results)
    if not rows:
        print("no runs", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    docs = Path(args.out).parent if args.out else REPO / "docs"
    plot(rows, docs / "quality-curves.png", docs / "quality-diffs.png")
    if args.out:
        _imports()
        cpu_run = sum(r["seconds"] for r in rows)
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "revision": git_revision(), "machine": machine(),
                "command": "SONARD=$PWD/bin/sonard .venv/bin/python scripts/quality.py"
                           + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
                "wall": (f"{len(rows)} runs, {wall / 60:.1f} min wall with {args.jobs} workers, training loops"
                         f" {cpu_run / 60:.1f} min in total; load average {load0:.1f} at the start,"
                         f" {os.getloadavg()[0]:.1f} at the end (the machine is shared; the losses do not"
                         " depend on it)." if not args.report_only else
                         f"{len(rows)} runs, training loops {cpu_run / 60:.1f} min in total (report redone"
                         " with --report-only).")}
        side = results.with_suffix(".meta.json")
        if args.report_only and side.exists():
            meta.update({k: v for k, v in json.loads(side.read_text()).items()
                         if k in ("wall", "command", "date", "revision", "notes")})
        else:
            side.write_text(json.dumps({k: meta[k] for k in ("wall", "command", "date")}))
        text = write_report(Path(args.out), rows, meta)
        print(text)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
