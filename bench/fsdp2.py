"""FSDP2 with the experts sharded too: SonarAdamW against torch.optim.AdamW, per rank.

    python bench/fsdp2.py [--model olmoe] [--layers 8] [--hidden 128] [--world 2] [--rounds 3]
                          [--sharding fsdp2|tp]

``--sharding tp``: instead of ``fully_shard``, the model is saved once and each rank loads it
tensor-parallel with transformers' own loading (``DistributedConfig(tp_size=world)``: the
experts sharded on their hidden dimensions, every rank fed the same batches, as tensor
parallel needs).

Starts one sonard (the node's, as ``NodeServer`` would) and ``--world`` ranks (gloo over
loopback, one torch thread each). Every rank builds the benchmark's small byte-level config
(bench/models.py, the real model's expert share of parameters), wraps each decoder layer and
the root in ``fully_shard`` (experts included: dim 0, the experts, is sharded; with
``--experts-group`` each layer's experts module is sharded first, as a group of its own, so that
its gradients have a reduce-scatter buffer of their own), and trains it in rounds, the methods
alternating:

  b  torch.optim.AdamW, no clipping (FSDP2's usual optimizer)
  d  SonarAdamW: each expert shard updated by sonard during backward, its gradient freed then

Reported per method: the median step time over all timed steps (rank 0's clock; the ranks
wait for each other in every collective), CPU seconds per step of all ranks together plus
sonard's, and rank 0's memory in one more step: glibc's heap bytes in use (``mallinfo2``; every
thread's, which torch.profiler's memory events are not here: gloo's threads free FSDP2's
buffers), sampled around each layer's forward and backward, when backward returns and after
the optimizer step, with the expert gradient shards alive when backward returns. Sonar's shared
memory (the expert shards) and rank 0's share of sonard's optimizer state are outside that heap
and are added to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples"), str(ROOT / "pyclient")]

import common  # noqa: E402


class Heap:
    """glibc's count of the heap bytes in use (``mallinfo2``: arena chunks in use plus mmapped
    ones): every thread's allocations, torch's and gloo's included, which torch.profiler's CPU
    memory events miss where another thread frees (FSDP2's collectives)."""

    def __init__(self) -> None:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = MallInfo2

    def used(self) -> int:
        m = self._libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ one rank
def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import models
    import sonar_moe
    import tiny_moe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    mesh = init_device_mesh("cpu", (a.world,))
    shape, _, _ = models.small_shape(a.model, a.hidden, a.layers)
    data = tiny_moe.load_corpus(400_000)
    tp = a.sharding == "tp"
    gen = torch.Generator().manual_seed(1000 + (0 if tp else a.rank))  # tensor parallel: the same batches
    batches = [{"input_ids": x, "labels": x} for x in tiny_moe.batches(data, a.batch, a.seq, gen, count=8)]
    if tp:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig
        os.environ.setdefault("LOCAL_RANK", str(a.rank))
        saved = os.path.join(a.model_dir, "model")
        if a.rank == 0:
            shape.build(a.impl, torch.float32, seed=7).save_pretrained(saved)
        dist.barrier()

    def build() -> tuple[Any, Any, list[str]]:
        if tp:
            model = AutoModelForCausalLM.from_pretrained(saved, experts_implementation=a.impl, dtype=torch.float32,
                                                         distributed_config=DistributedConfig(tp_size=a.world)).train()
        else:
            model = shape.build(a.impl, torch.float32, seed=7)
        if a.checkpointing:  # activation checkpointing per layer, as FSDP2 training usually runs
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if tp:
            experts = [n for n, p in model.named_parameters() if models.is_expert(n, p)]
            return model, experts, [n for n, _ in model.named_parameters()]
        for layer in model.model.layers:
            if a.experts_group:  # the experts' gradients in a reduce-scatter buffer of their own
                for name, sub in layer.named_modules():
                    if name.endswith("experts"):
                        fully_shard(sub, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        experts = [n for n, p in model.named_parameters() if models.is_expert(n, p)]
        return model, experts, [n for n, _ in model.named_parameters()]

    def nbytes(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    def step(model: Any, opt: Any, batch: dict[str, Any]) -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    heap = Heap()

    def profiled(model: Any, opt: Any, experts: set[str], batch: dict[str, Any]) -> dict[str, int]:
        """One step's memory on this rank (glibc's bytes in use, every thread's): the peak over
        the layers' forward and backward, what is alive when backward returns, after the optimizer
        step; and the expert gradient shards alive when backward returns."""
        params = dict(model.named_parameters())
        samples: list[int] = []

        def sample(*_: Any) -> None:
            samples.append(heap.used())
        hooks = []
        for layer in model.model.layers:
            hooks += [layer.register_forward_hook(sample), layer.register_full_backward_pre_hook(sample),
                      layer.register_full_backward_hook(sample)]
        gc.collect()
        sample()
        loss = model(**batch).loss
        loss.backward()
        del loss
        after_bwd = heap.used()
        grads = sum(nbytes(p.grad) for n, p in params.items() if n in experts and p.grad is not None)
        opt.step()
        after_step = heap.used()
        opt.zero_grad(set_to_none=True)
        for h in hooks:
            h.remove()
        return {"peak": max(samples + [after_bwd, after_step]), "after_backward": after_bwd, "after_step": after_step,
                "expert_grads_after_backward": grads}

    results: dict[str, Any] = {m: {"step_s": [], "cpu_s": [], "sonard_cpu_s": []} for m in a.methods}
    for rnd in range(a.rounds):
        for method in a.methods:
            model, experts, _ = build()
            if method == "b":
                opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                opt = sonar_moe.SonarAdamW(model, lr=1e-3, server=a.server, namespace=f"rank{a.rank}")
            for i in range(a.warmup):
                step(model, opt, batches[i % len(batches)])
            dist.barrier()
            cpu0, sonard0, t0 = time.process_time(), common.proc_cpu_s(a.sonard_pid), time.perf_counter()
            times = []
            for i in range(a.steps):
                t = time.perf_counter()
                step(model, opt, batches[(a.warmup + i) % len(batches)])
                times.append(time.perf_counter() - t)
            dist.barrier()
            wall = time.perf_counter() - t0
            cpu = torch.tensor([time.process_time() - cpu0])
            dist.all_reduce(cpu)
            r = results[method]
            r["step_s"] += times
            r["cpu_s"].append(float(cpu) / a.steps)
            r["sonard_cpu_s"].append((common.proc_cpu_s(a.sonard_pid) - sonard0) / a.steps if method == "d" else 0.0)
            r["wall_s"] = r.get("wall_s", 0.0) + wall
            if rnd == a.rounds - 1:
                r["memory"] = profiled(model, opt, set(experts), batches[0])
                if isinstance(opt, sonar_moe.SonarAdamW):
                    dist.barrier()  # every rank's session holds its state while the server is asked
                    s = opt.stats()
                    dist.barrier()
                    r["memory"].update(shm_params=s["param_segment_bytes"], ring=s["ring_bytes"],
                                       server_state=int(s["server"]["state_bytes"]),
                                       peak_expert_grad_bytes=s["peak_expert_grad_bytes"])
                r["expert_shard_bytes"] = sum(nbytes(p) for n, p in model.named_parameters() if n in experts)
            if isinstance(opt, sonar_moe.SonarAdamW):
                opt.close()
            del model, opt
    if a.rank == 0:
        print(json.dumps({"shape": shape.asdict(), "results": results}))
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("olmoe", "granite"), default="olmoe")
    ap.add_argument("--impl", default="grouped_mm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="bd")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    ap.add_argument("--sharding", choices=("fsdp2", "tp"), default="fsdp2",
                    help="fsdp2: fully_shard by hand; tp: transformers' tensor-parallel loading")
    ap.add_argument("--experts-group", action="store_true",
                    help="fully_shard each layer's experts module on its own before the layer")
    ap.add_argument("--sonard", default=os.environ.get("SONARD", str(ROOT / "bin" / "sonard")))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--sonard-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a)
        return
    with tempfile.TemporaryDirectory(prefix="sonar-fsdp2-") as tmp:
        address = f"ipc://{tmp}/sonard.sock"
        server = subprocess.Popen([a.sonard, "--listen", address, "--log-level", "warn"])
        try:
            for _ in range(100):
                if Path(tmp, "sonard.sock").exists():
                    break
                time.sleep(0.05)
            port = free_port()
            argv = [sys.executable, __file__, *sys.argv[1:]]
            ranks = [subprocess.Popen([*argv, "--rank", str(r), "--port", str(port), "--server", address,
                                       "--sonard-pid", str(server.pid), "--model-dir", tmp],
                                      stdout=subprocess.PIPE, text=True)
                     for r in range(a.world)]
            outs = [p.communicate()[0] for p in ranks]
            if any(p.returncode for p in ranks):
                raise SystemExit(f"a rank failed: {[p.returncode for p in ranks]}")
        finally:
            server.terminate()
            server.wait()
    got = json.loads(outs[0].strip().splitlines()[-1])
    if os.environ.get("FSDP2_BENCH_RAW"):
        print(json.dumps({m: r["memory"] for m, r in got["results"].items()}))
    report(a, got)


def report(a: argparse.Namespace, got: dict[str, Any]) -> None:
    res = got["results"]
    mib = 1 / 2**20
    how = "tensor parallel (transformers' loading)" if a.sharding == "tp" else "FSDP2, experts sharded"
    print(f"# {how}: {a.model} ({a.impl}), {a.layers} layers, hidden {a.hidden}, "
          f"{a.world} ranks, batch {a.batch}x{a.seq} per rank, {a.rounds} rounds x {a.steps} steps")
    print(f"# {common.cpu_model()}, {os.cpu_count()} CPUs, load {common.load_avg()}")
    grouping = ("experts split on their hidden dimensions" if a.sharding == "tp" else
                "experts sharded as a group of their own" if a.experts_group else "experts sharded with the layer")
    print(f"# {grouping}"
          f"{', activation checkpointing' if a.checkpointing else ''}; memory: rank 0's heap in use (MiB), plus "
          "for Sonar its shared memory and its share of sonard's state")
    print("| method | step (median) | vs (b) | CPU s/step, all ranks + sonard | vs (b) | peak | when backward returns | "
          "after the step | Sonar outside the heap | peak with it | vs (b) | backward's end with it | vs (b) | "
          "expert grad shards alive after backward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    b = res.get("b")
    for m, r in res.items():
        st = common.median(r["step_s"])
        cpu = common.median([c + s for c, s in zip(r["cpu_s"], r["sonard_cpu_s"])])
        mem = r["memory"]
        # sonard's state_bytes counts every rank's session: this rank's share (the shards are equal)
        outside = mem.get("shm_params", 0) + mem.get("ring", 0) + mem.get("server_state", 0) // a.world
        vs = st / common.median(b["step_s"]) if b else float("nan")
        vcpu = cpu / common.median([c + s for c, s in zip(b["cpu_s"], b["sonard_cpu_s"])]) if b else float("nan")
        peak, end = mem["peak"] + outside, mem["after_backward"] + outside
        bmem = b["memory"] if b else mem
        print(f"| {m} | {st * 1e3:.1f} ms | {vs:.3f}x | {cpu:.3f} | {vcpu:.3f}x | {mem['peak'] * mib:.2f} | "
              f"{mem['after_backward'] * mib:.2f} | {mem['after_step'] * mib:.2f} | {outside * mib:.2f} | "
              f"{peak * mib:.2f} | {peak / bmem['peak'] - 1:+.1%} | {end * mib:.2f} | "
              f"{end / bmem['after_backward'] - 1:+.1%} | "
              f"{mem['expert_grads_after_backward'] * mib:.2f} of {r['expert_shard_bytes'] * mib:.2f} |")


if __name__ == "__main__":
    main()
