"""What Sonar's gradient hooks cost the trainer per expert tensor. Prints one JSON document.

A model of many small expert tensors (one per expert, as a ``ModuleList`` of experts gives, or
``split_experts``), where the Python of each hook, not the update, is most of what Sonar adds
to a step. Two methods on the same tensors, each in a fresh process and interleaved round by
round so that a change of the machine's load hits both: torch's loop (``clip_grad_norm_`` over
all tensors, then ``torch.optim.AdamW``) and ``SonarAdamW(max_grad_norm=...)``, its hooks
handing each gradient over as backward produces it (``--layers``: the tensors spread over that
many MoE layers, a request a layer, which the next layer's first hook waits for). With
``--client DIR`` the SonarAdamW runs are repeated with the ``sonar_moe`` package under DIR
(another checkout's ``pyclient``, the same sonard): the before/after of a change to the client.

Per step: wall time, the trainer's CPU time and sonard's; per hook, the step's trainer CPU over
the tensors. Then, once the steps are done, the time of ``state_dict()`` and of
``load_state_dict()`` of what it returned (the median of three). Medians over the rounds; each
round's own median over its steps. ``--sonard`` gives the ``--client`` runs another sonard
binary (another checkout's ``bin/sonard``): the before/after of a change to both.

    .venv/bin/python bench/hooks.py --experts 128 --rounds 5
    .venv/bin/python bench/hooks.py --client ../old/pyclient     # before/after a client change
    .venv/bin/python bench/hooks.py --client ../old/pyclient --sonard ../old/bin/sonard
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(os.path.dirname(HERE), "pyclient")


def child(method: str, experts: int, numel: int, steps: int, threads: int, layers: int) -> dict:
    """One run in this process: `steps` timed steps (after 20 untimed) of `method`."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    params = [torch.randn(numel, requires_grad=True) for _ in range(experts)]
    weights = [torch.randn(numel) for _ in range(experts)]

    def loss() -> torch.Tensor:
        return torch.stack([(p * w).sum() for p, w in zip(params, weights)]).sum()

    server_pid = None
    opt: torch.optim.Optimizer
    if method == "torch":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

        def step() -> None:
            loss().backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
        close = None
    else:
        import sonar_moe
        # A layer's tensors go to sonard in one request, which the next layer's first hook waits for.
        named = [(f"layers.{i * layers // experts}.mlp.experts.{i}.w", p) for i, p in enumerate(params)]
        sopt = sonar_moe.SonarAdamW(named, lr=1e-3,
                                    weight_decay=0.01, max_grad_norm=1.0, expert_params=lambda name, t: True)
        proc = sopt.server_process
        server_pid = proc.pid if proc is not None else None
        opt = sopt

        def step() -> None:
            loss().backward()
            sopt.step()
            sopt.zero_grad()
        close = sopt.close
    walls, cpus, servers = [], [], []
    for i in range(steps + 20):
        s0 = common.proc_cpu_s(server_pid) if server_pid else 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        t1, c1 = time.perf_counter(), time.process_time()
        s1 = common.proc_cpu_s(server_pid) if server_pid else 0.0
        if i >= 20:
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
            servers.append(s1 - s0)
    saves, loads = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        sd = opt.state_dict()
        t1 = time.perf_counter()
        opt.load_state_dict(sd)
        saves.append(t1 - t0)
        loads.append(time.perf_counter() - t1)
    if close is not None:
        close()
    return {"step_s": common.median(walls), "trainer_cpu_s": common.median(cpus),
            "server_cpu_s": sum(servers) / len(servers),  # clock ticks: a mean, not a median
            "state_dict_s": common.median(saves), "load_state_dict_s": common.median(loads)}


def run(method: str, client: str, sonard: str | None, args: argparse.Namespace) -> dict:
    """One child process of `method` with the sonar_moe package under `client` (and that
    sonard binary, if given)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([client, HERE]))
    if sonard:
        env["SONARD"] = sonard
    out = subprocess.run([sys.executable, __file__, "--child", method, "--experts", str(args.experts),
                          "--numel", str(args.numel), "--steps", str(args.steps), "--threads", str(args.threads),
                          "--layers", str(args.layers)],
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the {method} run (client {client}) failed with exit status {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128, help="expert tensors (one hook each)")
    ap.add_argument("--numel", type=int, default=64, help="elements per expert tensor")
    ap.add_argument("--steps", type=int, default=200, help="timed steps a run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1, help="MoE layers the expert tensors are spread over")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP team to park)")
    ap.add_argument("--client", help="another checkout's pyclient: its SonarAdamW is measured too")
    ap.add_argument("--sonard", help="the sonard binary of the --client runs (default: the one SONARD names)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.experts, args.numel, args.steps, args.threads, args.layers)))
        return
    methods: dict[str, tuple[str, str, str | None]] = {"torch": ("torch", CLIENT, None),
                                                         "sonar": ("sonar", CLIENT, None)}
    if args.client:
        sonard = os.path.abspath(args.sonard) if args.sonard else None
        methods["sonar (--client)"] = ("sonar", os.path.abspath(args.client), sonard)
    rounds: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for name, (method, client, sonard) in methods.items():
            rounds[name].append(run(method, client, sonard, args))
    out: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": common.cpu_model(), "experts": args.experts,
                 "numel": args.numel, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
                 "layers": args.layers,
                 "transport": os.environ.get("SONAR_TRANSPORT", "zmq"), "methods": {}}
    base = common.median([r["step_s"] for r in rounds["torch"]])
    for name, rs in rounds.items():
        step = common.median([r["step_s"] for r in rs])
        cpu = common.median([r["trainer_cpu_s"] + r["server_cpu_s"] for r in rs])
        trainer = common.median([r["trainer_cpu_s"] for r in rs])
        out["methods"][name] = {"step_ms": step * 1e3, "step_vs_torch": step / base,
                                "trainer_cpu_ms": trainer * 1e3, "cpu_ms_trainer_and_sonard": cpu * 1e3,
                                "trainer_cpu_us_per_hook": trainer * 1e6 / args.experts,
                                "state_dict_ms": common.median([r["state_dict_s"] for r in rs]) * 1e3,
                                "load_state_dict_ms": common.median([r["load_state_dict_s"] for r in rs]) * 1e3,
                                "rounds_step_ms": [r["step_s"] * 1e3 for r in rs]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
