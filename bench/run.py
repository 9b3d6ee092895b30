"""Sonar-MoE benchmark suite: one entry point that measures everything and writes the report.

    python bench/run.py            # full run (~15-20 min on 2 cores): docs/benchmarks.md, docs/*.png
    python bench/run.py --quick    # ~3 min smoke run: writes bench/quick/ (not docs/)
    python bench/run.py --report-only bench/results/full.json   # re-render a saved run

It builds bin/sonard and bin/sonar-bench (scripts/build-go sonard sonar-bench), then runs
  1. kernels: the Go engine in-process (cmd/sonar-bench: IEEE and MKL sqrt), torch CPU AdamW
     (single-tensor, foreach, fused), copy bandwidth, sonard end to end (bench/kernel.py);
  2. training: small OLMoE (eager and grouped_mm experts) and GraniteMoe configs whose expert
     share matches the real models, five optimizer methods each (bench/train.py);
  3. the report: tables, targets met or missed, docs/memory-timeline.png, docs/ipc-latency.png.
Timings are reported, never asserted. Raw numbers go to bench/results/<mode>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import ROOT

PY = sys.executable

# Training methods of the main configs (bench/train.py's letters), and of the spare-core runs:
# torch limited to fewer threads than cores, so sonard has a core of its own.
METHODS, SPARE_METHODS = "abcdqefgsohuknxywr", "nbcdgso"
# The methods the step targets compare, trained again in runs of their own ("repeats"): one run's
# ratio moves by several percent on these shared machines (docs/results-history.md, 2026-12-05,
# "GraniteMoe on an Intel Xeon"), so the targets take the median over the main run and these.
REPEAT_METHODS = "abcdq"
# The same configs with libgomp's spin-wait shortened (GOMP_SPINCOUNT, read when torch loads
# libgomp): torch's idle OpenMP threads then sleep instead of spinning while a hook waits for sonard.
SPIN_METHODS, SPIN_COUNT = "bcdo", "10000"
FULL = dict(sizes="1M,16M,64M", contended="16M", reps=9, pings=2000, layers=8, hidden=128, batch=4, seq=64, warmup=3, steps=30,
            models=[("olmoe", "eager"), ("olmoe", "grouped_mm"), ("granite", "grouped_mm")],
            spare=[("olmoe", "grouped_mm", 1), ("granite", "grouped_mm", 1)],
            spin=[("olmoe", "grouped_mm"), ("granite", "grouped_mm")],
            depth=[("olmoe", "grouped_mm", 16), ("granite", "grouped_mm", 32)], park_rounds=40, repeats=4)
QUICK = dict(sizes="1M,16M", contended="1M", reps=3, pings=500, layers=4, hidden=128, batch=4, seq=64, warmup=1, steps=5,
             models=[("olmoe", "eager"), ("olmoe", "grouped_mm"), ("granite", "grouped_mm")],
             spare=[("olmoe", "grouped_mm", 1)],
             spin=[("granite", "grouped_mm")],
             depth=[("olmoe", "grouped_mm", 8)], park_rounds=10, repeats=1)


BUILD = ["scripts/build-go", "sonard", "sonar-bench"]  # the one build entry point, into bin/


def build(env: dict[str, str]) -> None:
    if shutil.which("go", path=env.get("PATH")) is None:
        raise SystemExit("go is needed to build bin/sonard and bin/sonar-bench (scripts/build-go)")
    subprocess.run([str(ROOT / BUILD[0]), *BUILD[1:]], check=True, cwd=ROOT, env=env)


BEFORE_BENCH = "bench/before/sonar-bench"  # cmd/sonar-bench built from --before's commit
BEFORE_SONARD = "bench/before/sonard"  # and cmd/sonard: training method (v)


def build_before(rev: str, env: dict[str, str]) -> str:
    """Build cmd/sonar-bench and cmd/sonard at commit rev (a temporary git worktree) into BEFORE_BENCH
    and BEFORE_SONARD; rev's short hash."""
    import tempfile
    short = subprocess.run(["git", "rev-parse", "--short", rev], check=True, capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    wt = Path(tempfile.mkdtemp(prefix="sonar-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(wt), rev], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    try:
        subprocess.run([str(wt / BUILD[0]), "sonar-bench", "sonard"], check=True, cwd=wt, env=env)
        for name, dest in (("sonar-bench", ROOT / BEFORE_BENCH), ("sonard", ROOT / BEFORE_SONARD)):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(wt / "bin" / name, dest)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], check=True, cwd=ROOT)
        shutil.rmtree(wt.parent, ignore_errors=True)
    return short


def machine(env: dict[str, str]) -> dict:
    import torch
    flags = common.cpu_flags()
    go = subprocess.run(["go", "version"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "nproc": os.cpu_count(), "cpu_model": common.cpu_model(),
        "isa": " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512vbmi", "amx_bf16") if f in flags),
        "mem_gib": round(common.mem_total_gib(), 1), "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
        "go": go, "commit": git.stdout.strip() or "unknown", "load_start": common.load_avg(),
        "cpu_idle": common.cpu_idle(), "llc_mib": common.last_level_cache_mib(),
    }


def run_all(cfg: dict, quick: bool, env: dict[str, str], before: str | None = None) -> dict:
    res: dict = {"mode": "quick" if quick else "full", "config": {k: v for k, v in cfg.items()}}
    res["machine"] = machine(env)
    if before:
        res["machine"]["before"] = before
    lib = common.torch_lib()
    cmds = []
    print("kernels: Go engine (cmd/sonar-bench), torch AdamW, copy, sonard end to end (bench/kernel.py)",
          file=sys.stderr, flush=True)
    py_cmd = [PY, "bench/kernel.py", "--sizes", cfg["sizes"], "--reps", str(cfg["reps"]), "--pings", str(cfg["pings"]),
              "--go-bench", "bin/sonar-bench", "--torch-lib", lib, "--contended", cfg["contended"]]
    if before:
        py_cmd += ["--go-bench-before", BEFORE_BENCH]
    res["torch"] = common.run_json(py_cmd, env)
    cmds.append(py_cmd)
    def train(model: str, impl: str, methods: str, layers: int | None = None, warmup: int | None = None,
              steps: int | None = None, extra: tuple[str, ...] = (), run_env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> dict:
        """One bench/train.py run of a config (the run's shape unless told otherwise)."""
        cmd = [PY, "bench/train.py", "--model", model, "--impl", impl, "--layers", str(layers or cfg["layers"]),
               "--hidden", str(cfg["hidden"]), "--batch", str(cfg["batch"]), "--seq", str(cfg["seq"]),
               "--warmup", str(cfg["warmup"] if warmup is None else warmup),
               "--steps", str(cfg["steps"] if steps is None else steps), "--methods", methods, *extra]
        cmds.append([*prefix, *cmd])
        return common.run_json(cmd, run_env or env)

    res["train"] = []
    methods, train_env = METHODS, env
    prefix: tuple[str, ...] = ()
    if before:  # (v): (d) with sonard as built at the BEFORE commit, in the same runs
        methods, train_env = METHODS + "v", {**env, "SONAR_BENCH_BEFORE_SONARD": str(ROOT / BEFORE_SONARD)}
        prefix = (f"SONAR_BENCH_BEFORE_SONARD={BEFORE_SONARD}",)
    for model, impl in cfg["models"]:
        print(f"training: {model} / {impl}", file=sys.stderr, flush=True)
        res["train"].append(train(model, impl, methods, run_env=train_env, prefix=prefix))
    res["repeats"] = []
    for i in range(cfg["repeats"]):  # round by round over the configs, so a slow spell hits them alike
        for model, impl in cfg["models"]:
            print(f"training again, {REPEAT_METHODS} only ({i + 1} of {cfg['repeats']}): {model} / {impl}",
                  file=sys.stderr, flush=True)
            res["repeats"].append(train(model, impl, REPEAT_METHODS, extra=("--timeline", "")))
    res["spare"] = []
    for model, impl, threads in cfg["spare"]:
        print(f"training with a spare core: {model} / {impl}, torch at {threads} thread(s)", file=sys.stderr, flush=True)
        res["spare"].append(train(model, impl, SPARE_METHODS, extra=("--threads", str(threads), "--timeline", "")))
    res["spin"] = []
    for model, impl in cfg["spin"]:
        print(f"training with GOMP_SPINCOUNT={SPIN_COUNT}: {model} / {impl}", file=sys.stderr, flush=True)
        r = train(model, impl, SPIN_METHODS, extra=("--timeline", ""), run_env={**env, "GOMP_SPINCOUNT": SPIN_COUNT},
                  prefix=(f"GOMP_SPINCOUNT={SPIN_COUNT}",))
        r["gomp_spincount"] = int(SPIN_COUNT)
        res["spin"].append(r)
    print("ending a park of torch's OpenMP threads (bench/park.py)", file=sys.stderr, flush=True)
    park_cmd = [PY, "bench/park.py", "--rounds", str(cfg["park_rounds"])]
    res["park"] = common.run_json(park_cmd, env)
    cmds.append(park_cmd)
    res["depth"] = []
    for model, impl, layers in cfg["depth"]:
        print(f"memory at depth {layers}: {model} / {impl}", file=sys.stderr, flush=True)
        res["depth"].append(train(model, impl, "acdf", layers=layers, warmup=2, steps=0, extra=("--timeline", "")))
    res["machine"]["load_end"] = common.load_avg()
    res["commands"] = [" ".join("$TORCH_LIB" if c == lib else c.replace(str(ROOT) + os.sep, "") if c != PY
                                else "$PY" for c in cmd) for cmd in cmds]
    return res


def scrub(obj: Any, env: dict[str, str]) -> Any:
    """Replace this machine's paths (repo, venv, torch library) in the saved results."""
    subs = sorted({(str(ROOT), "."), (sys.prefix, "$VENV"), (common.torch_lib(), "$TORCH_LIB"),
                   (env.get("SONARD", ""), "$SONARD")} - {("", "$SONARD")}, key=lambda kv: -len(kv[0]))
    if isinstance(obj, dict):
        return {k: scrub(v, env) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, env) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, str):
        for a, b in subs:
            obj = obj.replace(a, b)
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~3 minute smoke run (smaller sizes, fewer steps)")
    ap.add_argument("--out", help="directory of the report and PNGs (default: docs, or bench/quick with --quick)")
    ap.add_argument("--report-only", metavar="JSON", help="re-render the report from saved results")
    ap.add_argument("--before", metavar="REV", help="also measure the Go kernels as built at this commit, "
                    "beside today's, for a before/after table (make bench BEFORE=REV)")
    a = ap.parse_args()
    out = Path(a.out) if a.out else ROOT / ("bench/quick" if a.quick else "docs")
    out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        res = json.loads(Path(a.report_only).read_text())
    else:
        env = dict(os.environ)
        env.setdefault("SONARD", str(ROOT / "bin" / "sonard"))
        build(env)
        before = build_before(a.before, env) if a.before else None
        t = time.perf_counter()
        res = run_all(QUICK if a.quick else FULL, a.quick, env, before)
        res["wall_s"] = time.perf_counter() - t
        results = ROOT / "bench" / "results"
        results.mkdir(exist_ok=True)
        (results / f"{res['mode']}.json").write_text(json.dumps(scrub(res, env)))
    import report
    report.write(res, out)
    print(f"wrote {out / 'benchmarks.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
