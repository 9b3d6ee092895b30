"""Training benchmark of one small MoE config: five optimizer methods trained side by side on
the same batches, one step of each in turn (round-robin, so drift of the machine's load
hits every method alike), in an order shuffled anew each step (seeded), so that no method
always follows the same one: an effect of one method's step on the next (separate runs of
2026-12-05 suggested one after optimizer-in-backward (c); alternating the orders within one
run on 2026-12-06 found none, docs/results-history.md) would otherwise fall on one method.
Prints one JSON document.

Methods:
  a  torch.optim.AdamW + clip_grad_norm_(all params, 1.0)
  b  torch.optim.AdamW, no clipping
  c  optimizer-in-backward over all params: one torch AdamW per parameter, stepped in a
     post-accumulate-grad hook (the PyTorch tutorial's method; no global clipping possible)
  d  SonarAdamW(max_grad_norm=1.0): batched expert tensors updated by sonard during backward
  q  SonarAdamW without clipping: torch AdamW's updates, as (b) makes them, so its model and the
     work of its forward and backward follow (b)'s (as (c)'s do), where (d)'s clipping trains
     a model of its own
  e  SonarAdamW(max_grad_norm=1.0, split_experts=True): one request per expert slice
  f  SonarAdamW(max_grad_norm=1.0, zero_copy=False): (d) with each gradient copied through the
     shared-memory ring, as before zero copy (d reads gradients in place where the server can)
  s  (d) with ring_layers=0: each hook waits for its own update, nothing waits for the server
  o  (d) with ring_layers=1: one layer may wait (the updates overlap backward)
  h  (d) with ring_layers=2: two layers may wait
  (d) leaves ring_layers unset: 0 where torch's threads take every core, else 1
  n  no optimizer: forward, backward and zero_grad only (the floor each method adds its
     update to; not run by default)
  g  (d) with a one-worker sonard (SONAR_WORKERS=1 in its environment) instead of one worker per
     core: fewer threads competing with torch's for the cores ((d)'s private sonard runs the
     cores torch leaves free, one per core where it leaves none: with --threads 1 on 2 cores,
     (d) and (g) are the same)
  u  (d) with torch's OpenMP threads left to spin while the trainer waits (SONAR_OPENMP_PARK=0
     when it is built): Sonar before it parked them (sonar_moe/_openmp.py)
  k  (d) with the parked threads left where Linux wakes them (SONAR_OPENMP_STEER=0): Sonar
     before it kept them off the waiting thread's CPU while waking them
  x  (d) with its private sonard spoken to over sonard's own Unix socket (SONAR_TRANSPORT=unix)
  z  (d) with its private sonard spoken to over ZeroMQ (SONAR_TRANSPORT=zmq)
  y  (e) over sonard's own Unix socket: one request per expert slice, each without ZeroMQ
  w  (d) with sonard's workers never polling (SONAR_SPIN=0): each tensor's helper goroutine
     started when its arithmetic starts and the request's wait for it blocking, as before
     2026-12-02 (optimizer/helpers.go)
  r  (d) with sonard's workers left where Linux wakes them (SONAR_STEER=0): each helper of a
     request's goroutine may share its CPU, as before 2026-12-05 (optimizer/helpers.go)
  v  (d) with sonard as built at another commit (the binary in $SONAR_BENCH_BEFORE_SONARD;
     make bench BEFORE=REV builds it): the server before this change, in the same run

Memory (per method, one extra profiled step after the timed ones): the trainer's tensor
bytes are the bytes alive before the step (parameters outside shared memory, gradients,
optimizer state, buffers: enumerated, storages counted once) plus the running sum of
torch's CPU allocator events (torch.profiler, profile_memory=True) during the step; the
peak of that sum is the trainer's peak. Sonar adds what lives outside torch's allocator:
the shared-memory segments (expert parameters, gradient ring) and sonard's optimizer
state (stats()['server']['state_bytes']).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import sys
import time
from typing import Any

import common
import torch
from torch import nn

import models
import sonar_moe
import tiny_moe

METHODS = {
    "a": "torch AdamW + clip (all params)",
    "b": "torch AdamW, no clip",
    "c": "optimizer-in-backward (all params)",
    "d": "SonarAdamW batched",
    "q": "SonarAdamW batched, no clip",
    "e": "SonarAdamW split_experts",
    "f": "SonarAdamW batched, ring (zero_copy=False)",
    "g": "SonarAdamW batched, 1-worker sonard",
    "s": "SonarAdamW batched, ring_layers=0",
    "o": "SonarAdamW batched, ring_layers=1",
    "h": "SonarAdamW batched, ring_layers=2",
    "u": "SonarAdamW batched, OpenMP threads not parked",
    "k": "SonarAdamW batched, parked threads not steered",
    "x": "SonarAdamW batched, unix:// transport",
    "z": "SonarAdamW batched, ZeroMQ transport",
    "y": "SonarAdamW split_experts, unix:// transport",
    "w": "SonarAdamW batched, workers never poll (SONAR_SPIN=0)",
    "r": "SonarAdamW batched, workers not steered (SONAR_STEER=0)",
    "v": "SonarAdamW batched, sonard of the BEFORE commit",
    "n": "no optimizer (forward + backward only)",
}
LR, WD, CLIP = 1e-3, 0.01, 1.0


def sonar_seconds(opt: sonar_moe.SonarAdamW | None) -> tuple[float, float, float]:
    """Seconds SonarAdamW has spent so far in its gradient hooks, waiting for updates in step(),
    and (part of the first) waiting in the hooks for room in the gradient ring."""
    if opt is None:
        return 0.0, 0.0, 0.0
    st = opt.stats(server=False)
    return st["hand_over_s"], st["wait_s"], st.get("room_wait_s", 0.0)


def server_phases(server: dict[str, Any]) -> dict[str, float]:
    """sonard's seconds so far in the page check, the gradient reads and the arithmetic."""
    return {k: float(server.get(f"{k}_s", 0.0)) for k in ("check", "read", "kernel")}


class Method:
    def __init__(self, key: str, model: nn.Module) -> None:
        self.key, self.model = key, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sonar: sonar_moe.SonarAdamW | None = None
        self.opt: Any = None
        self.per_param: dict[torch.Tensor, torch.optim.Optimizer] = {}
        if key in ("a", "b"):
            self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD)
        elif key == "n":
            pass
        elif key == "c":
            for p in self.params:
                self.per_param[p] = torch.optim.AdamW([p], lr=LR, weight_decay=WD)
                p.register_post_accumulate_grad_hook(self._in_backward)
        else:
            # SONAR_WORKERS and SONAR_SPIN are read by the private sonard at its start, SONAR_OPENMP_PARK when
            # SonarAdamW is built.
            # (v): sonard as built at make bench's BEFORE commit (bench/run.py sets the variable).
            before = os.environ.get("SONAR_BENCH_BEFORE_SONARD", "")
            if key == "v" and not before:
                raise SystemExit("method v needs $SONAR_BENCH_BEFORE_SONARD (make bench BEFORE=REV sets it)")
            env = {"v": {"SONARD": before}, "g": {"SONAR_WORKERS": "1"},
                   "u": {"SONAR_OPENMP_PARK": "0"}, "k": {"SONAR_OPENMP_STEER": "0"},
                   "x": {"SONAR_TRANSPORT": "unix"}, "y": {"SONAR_TRANSPORT": "unix"}, "z": {"SONAR_TRANSPORT": "zmq"},
                   "w": {"SONAR_SPIN": "0"}, "r": {"SONAR_STEER": "0"}}.get(key, {})
            with common.environ(env):
                self.sonar = sonar_moe.SonarAdamW(model, lr=LR, weight_decay=WD, max_grad_norm=None if key == "q" else CLIP,
                                                  split_experts=key in "ey", zero_copy=False if key == "f" else None,
                                                  ring_layers={"s": 0, "o": 1, "h": 2}.get(key))
            self.opt = self.sonar
        self.times: list[float] = []
        self.losses: list[float] = []
        self.hook_s: list[float] = []
        self.drain_s: list[float] = []
        self.room_wait_s: list[float] = []
        self.cpu_s: list[float] = []  # trainer process (all threads) + its sonard, per timed step
        self.server_cpu_s: list[float] = []
        self.server_switches: list[int] = []  # the private sonard's context switches per timed step
        # Where the timed steps begin in SonarAdamW's records (start_timing, when the warm-up ends).
        self.lat0 = self.trace0 = self.req0 = 0
        self.phases0: dict[str, float] = {}

    def _in_backward(self, p: torch.Tensor) -> None:
        o = self.per_param[p]
        o.step()
        o.zero_grad(set_to_none=True)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        loss = self.model(**batch).loss
        loss.backward()
        self.update()
        return float(loss.detach())

    def update(self) -> None:
        """What follows backward: clipping (a), the optimizer's step and zero_grad."""
        if self.key == "a":
            torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        elif self.key == "n":
            self.model.zero_grad(set_to_none=True)

    def start_timing(self) -> None:
        """Mark where the timed steps begin in SonarAdamW's records (latencies, traces, request
        count, sonard's phase times), so the results count the timed steps only."""
        if self.sonar is None:
            return
        self.req0 = self.sonar.stats(server=False)["step_requests"]
        self.phases0 = server_phases(self.sonar.stats()["server"])
        # After stats(), whose own round trip is not one of the timed steps' requests.
        self.lat0 = len(self.sonar.request_latencies)
        self.trace0 = len(self.sonar.request_traces)

    def timed_step(self, batch: dict[str, torch.Tensor], record: bool) -> None:
        h0, d0, r0 = sonar_seconds(self.sonar)
        s0, w0 = self.server_cpu(), self.server_switches_now()
        c0 = time.process_time()
        t = time.perf_counter()
        loss = self.step(batch)
        dt = time.perf_counter() - t
        c1 = time.process_time()
        s1, w1 = self.server_cpu(), self.server_switches_now()
        self.losses.append(loss)
        if record:
            self.times.append(dt)
            self.cpu_s.append(c1 - c0 + s1 - s0)
            self.server_cpu_s.append(s1 - s0)
            self.server_switches.append(w1 - w0)
            if self.sonar is not None:
                h1, d1, r1 = sonar_seconds(self.sonar)
                self.hook_s.append(h1 - h0)
                self.room_wait_s.append(r1 - r0)
                self.drain_s.append(d1 - d0)

    def server_pid(self) -> int | None:
        """The private sonard's process id (None for torch methods)."""
        proc = self.sonar.server_process if self.sonar is not None else None
        return proc.pid if proc is not None else None

    def server_cpu(self) -> float:
        """CPU seconds the private sonard has used (0 for torch methods)."""
        pid = self.server_pid()
        return common.proc_cpu_s(pid) if pid is not None else 0.0

    def server_switches_now(self) -> int:
        """Context switches of the private sonard's threads so far (0 for torch methods)."""
        pid = self.server_pid()
        return common.proc_switches(pid) if pid is not None else 0

    # ---------------------------------------------------------------- memory
    def live_bytes(self) -> dict[str, int]:
        """Bytes in torch's CPU allocator alive between steps, by kind (storages counted once),
        and the bytes Sonar keeps outside it."""
        seen: set[int] = set()
        shm = set()
        if self.sonar is not None:
            shm = {p.untyped_storage().data_ptr() for _, p in self.sonar.named_expert_parameters()}

        def size(t: torch.Tensor | None) -> int:
            if t is None or not isinstance(t, torch.Tensor):
                return 0
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in seen or ptr in shm or ptr == 0:
                return 0
            seen.add(ptr)
            return st.nbytes()

        out = {"params": sum(size(p) for p in self.model.parameters()),
               "buffers": sum(size(b) for b in self.model.buffers()),
               "grads": sum(size(p.grad) for p in self.model.parameters())}
        states = []
        if self.key in ("a", "b"):
            states = [self.opt.state]
        elif self.key == "c":
            states = [o.state for o in self.per_param.values()]
        elif self.sonar is not None:
            states = [self.sonar.state]  # dense moments; an expert's entry holds only its step here
        # dict.values: what each entry holds locally (an expert's moments are on the server, read on demand)
        out["optimizer_state"] = sum(size(v) for st in states for s in st.values() for v in dict.values(s))
        if self.sonar is not None:
            s = self.sonar.stats()
            out["shm_params"] = s["param_segment_bytes"]
            out["shm_ring"] = s["ring_bytes"]
            out["server_state"] = int(s["server"]["state_bytes"])
        return out

    def profiled_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One step under the memory profiler: peak bytes and a (time, bytes) timeline."""
        gc.collect()
        live = self.live_bytes()
        base = live["params"] + live["buffers"] + live["grads"] + live["optimizer_state"]
        outside = live.get("shm_params", 0) + live.get("shm_ring", 0) + live.get("server_state", 0)
        from torch.profiler import ProfilerActivity, profile, record_function
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("bench::forward"):
                loss = self.model(**batch).loss
            with record_function("bench::backward"):
                loss.backward()
            with record_function("bench::optimizer"):
                if self.key == "a":
                    torch.nn.utils.clip_grad_norm_(self.params, CLIP)
                if self.opt is not None:
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
        evs = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        t0 = evs[0].start_ns() if evs else 0
        phases = {}
        cur, peak, t_peak = 0, 0, 0.0
        tl_t, tl_b = [0.0], [base]
        for e in evs:
            name = e.name()
            if name.startswith("bench::"):
                phases[name.removeprefix("bench::")] = ((e.start_ns() - t0) / 1e6, (e.end_ns() - t0) / 1e6)
            elif name == "[memory]":  # CPU allocator events (no other device here)
                cur += e.nbytes()
                ms = (e.start_ns() - t0) / 1e6
                tl_t.append(ms)
                tl_b.append(base + cur)
                if cur > peak:
                    peak, t_peak = cur, ms
        end = max((p[1] for p in phases.values()), default=tl_t[-1])
        # Thin the timeline for the plot: keep every local change, at most ~4000 points.
        stride = max(1, len(tl_t) // 4000)
        tl = [(tl_t[i], tl_b[i]) for i in range(0, len(tl_t), stride)] + [(end, tl_b[-1])]
        return {"live_before": live, "trainer_base": base, "trainer_peak": base + peak, "outside": outside,
                "total_peak": base + peak + outside, "peak_at_ms": t_peak, "phases": phases,
                "timeline": tl, "loss": float(loss.detach())}

    def close(self) -> None:
        if self.sonar is not None:
            self.sonar.close()


def heldout_loss(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        v = sum(float(model(**b).loss) for b in batches) / len(batches)
    model.train()
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("olmoe", "granite"), default="olmoe")
    ap.add_argument("--impl", default="eager", help="experts implementation: eager, grouped_mm, batched_mm")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    ap.add_argument("--methods", default="abcdefg")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--timeline", default="ad", help="methods whose profiled-step timeline is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for the trainer (0: torch's default, one per core)")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="keep all activations (default: gradient checkpointing, non-reentrant)")
    a = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    dtype = getattr(torch, a.dtype)
    shape, small, real = models.small_shape(a.model, a.hidden, a.layers)
    data = tiny_moe.load_corpus(400_000)
    split = int(len(data) * 0.9)
    gen = torch.Generator().manual_seed(a.seed)
    n_train = a.warmup + a.steps + 1
    train = [{"input_ids": x, "labels": x} for x in tiny_moe.batches(data[:split], a.batch, a.seq, gen, count=n_train)]
    held = [{"input_ids": x, "labels": x} for x in tiny_moe.batches(data[split:], a.batch, a.seq, gen, count=4)]

    base_model = shape.build(a.impl, dtype, a.seed)
    state = copy.deepcopy(base_model.state_dict())
    methods: list[Method] = []
    for k in a.methods:
        model = shape.build(a.impl, dtype, a.seed)
        model.load_state_dict(state)
        if not a.no_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        methods.append(Method(k, model))
    del base_model, state
    gc.collect()

    print(f"  {a.model}/{a.impl}: {small['total'] / 1e6:.2f} M params, expert share {small['share']:.4f} "
          f"(real {real['share']:.4f}), methods {a.methods}", file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            for m in methods:  # latencies and request counts of the timed steps only
                m.start_timing()
        order = methods[:]
        random.Random(a.seed * 100_003 + i).shuffle(order)
        for m in order:
            m.timed_step(train[i], record=i >= a.warmup)
    train_s = time.perf_counter() - t_start
    res_methods: dict[str, dict[str, Any]] = {}
    for m in methods:
        r: dict[str, Any] = {"label": METHODS[m.key], "median_step_s": common.median(m.times),
                             "step_times_s": m.times, "losses": m.losses,
                             # means, not medians: sonard's CPU time has clock-tick (10 ms) resolution
                             "cpu_s_per_step": sum(m.cpu_s) / max(len(m.cpu_s), 1),
                             "server_cpu_s_per_step": sum(m.server_cpu_s) / max(len(m.server_cpu_s), 1),
                             "server_switches_per_step": common.median([float(x) for x in m.server_switches])}
        if m.sonar is not None:
            n_lat = len(m.sonar.request_latencies)  # before stats() adds its own round trip
            st = m.sonar.stats()
            r["sonar"] = {k: v for k, v in st.items() if k != "server"}
            r["server"] = st["server"]
            lat = sorted(m.sonar.request_latencies[m.lat0:n_lat])
            r["latencies_s"] = lat
            r["latency_ms_p50"] = 1e3 * lat[len(lat) // 2] if lat else float("nan")
            r["latency_ms_p99"] = 1e3 * lat[min(len(lat) - 1, len(lat) * 99 // 100)] if lat else float("nan")
            r["requests_per_step"] = (st["step_requests"] - m.req0) / max(a.steps, 1)
            # Where a step request's round trip went (client and server readings of one clock), p50 us.
            traces = [t for t in m.sonar.request_traces[m.trace0:] if t.op == "step"]
            if traces:
                # The end of the client's wait (from the reply's bytes to the wait's return: torch's
                # parked threads woken and the parallel region closed), every request: its tail.
                r["wake_us"] = sorted((t.woke - t.got) / 1e3 for t in traces)
                r["step_trace_p50_us"] = sonar_moe.RequestTrace.median_segments(traces)
                r["step_trace_p50_us"]["server_step"] = common.median([float(t.server_us) for t in traces])
                r["step_trace_count"] = len(traces)
            # Where sonard's time went, per timed step (wall time added over its workers).
            p0, p1 = m.phases0, server_phases(st["server"])
            r["server_phase_s_per_step"] = {k: (v - p0.get(k, 0.0)) / max(a.steps, 1) for k, v in p1.items()}
            r["hook_s_median"] = common.median(m.hook_s)
            r["drain_s_median"] = common.median(m.drain_s)
            r["room_wait_s_median"] = common.median(m.room_wait_s)
            if (pid := m.server_pid()) is not None:
                r["server_proc"] = common.proc_status(pid)
        r["heldout_loss"] = heldout_loss(m.model, held)
        res_methods[m.key] = r
    if "b" in res_methods:  # how far each method's training losses drift from (b)'s (relative, worst step)
        ref = res_methods["b"]["losses"]
        for r in res_methods.values():
            r["loss_drift_vs_b"] = max((abs(x - y) / abs(y) for x, y in zip(r["losses"], ref)), default=0.0)
    # Memory: one profiled step per method (after the timed ones; its timing is not used).
    for m in methods:
        mem = m.profiled_step(train[a.warmup + a.steps])
        if m.key not in a.timeline:
            mem.pop("timeline")
        res_methods[m.key]["memory"] = mem
    for m in methods:
        m.close()
    e_bytes = small["expert"] * torch.finfo(dtype).bits // 8
    out = {
        "model": a.model, "impl": a.impl, "dtype": a.dtype, "shape": shape.asdict(), "counts": small,
        "real": {**models.REAL[a.model], **real}, "batch": a.batch, "seq": a.seq, "warmup": a.warmup,
        "steps": a.steps, "threads": torch.get_num_threads(), "checkpointing": not a.no_checkpointing, "train_wall_s": train_s,
        "expert_grad_bytes": e_bytes, "expert_grad_bytes_per_layer": e_bytes // a.layers,
        "load_avg": common.load_avg(), "methods": res_methods,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
