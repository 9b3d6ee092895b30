"""A trainer process for the multi-process tests: trains the tiny MoE against a shared
sonard and checks every step against torch.optim.AdamW in the same process.

    python tests/worker.py ADDRESS SEED STEPS [--die-after-backward] [--bf16]

--bf16 trains bfloat16 tensors (whose sqrt is IEEE everywhere): for servers that cannot load
this torch's float32 sqrt library (tcp://).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "pyclient")]

import torch  # noqa: E402

import sonar_moe  # noqa: E402
import tiny_moe as tm  # noqa: E402


def main() -> int:
    addr, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    die = "--die-after-backward" in sys.argv
    dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
    torch.set_num_threads(1)
    cfg = tm.MoEConfig(num_layers=2, num_experts=4, hidden=32, intermediate=48, dtype=dtype)
    ref, mine = tm.build(cfg, seed), tm.build(cfg, seed)
    experts = set(tm.expert_param_names(ref))
    dense = [p for n, p in ref.named_parameters() if n not in experts]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    data = tm.batches(tm.load_corpus(50_000), 2, 16, gen)
    with sonar_moe.SonarAdamW(mine, lr=1e-3, max_grad_norm=1.0, server=addr) as opt:
        for step in range(steps):
            x = next(data)
            loss, _ = ref(x, labels=x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dense, 1.0)
            ropt.step()
            ropt.zero_grad()
            loss, _ = mine(x, labels=x)
            loss.backward()
            if die:
                print("READY", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
                if not torch.equal(a, b):
                    print(f"MISMATCH seed {seed} step {step + 1} {n}", flush=True)
                    return 1
        st = opt.stats()
    print(f"OK seed {seed} steps {steps} p99_ms {st['latency_ms_p99']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
