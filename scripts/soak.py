"""Load and soak: several trainer processes on one shared sonard for many steps.

Each trainer (tests/worker.py) checks every step bit for bit against torch.optim.AdamW in
its own process, so cross-talk between clients would show as a mismatch. While they run,
the server's resident memory, open file descriptors and the sonar-* shared-memory objects
are sampled once a second.

    .venv/bin/python scripts/soak.py --clients 4 --steps 2000
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pyclient"))

from sonar_moe import find_sonard  # noqa: E402
from sonar_moe import Connection  # noqa: E402


def sample(pid: int) -> tuple[int, int, int]:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    shm = sum(1 for n in os.listdir("/dev/shm") if n.startswith("sonar-"))
    return rss, fds, shm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    rundir = tempfile.mkdtemp(prefix="sonar-soak-")
    addr = f"ipc://{rundir}/sonard.sock"
    # A plain server: each trainer names its torch's float32 sqrt in hello.
    server = subprocess.Popen([find_sonard(), "--listen", addr, "--log-level", "warn"])
    time.sleep(0.5)
    start = time.monotonic()
    workers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "worker.py"), addr, str(seed), str(args.steps)],
                                stdout=subprocess.PIPE, text=True) for seed in range(args.clients)]
    samples = []
    while any(w.poll() is None for w in workers):
        samples.append((time.monotonic() - start, *sample(server.pid)))
        time.sleep(1.0)
    outs = [w.communicate()[0] for w in workers]
    elapsed = time.monotonic() - start
    conn = Connection(addr, timeout=10)
    st = conn.call("stats", {})
    conn.close()
    final = sample(server.pid)
    server.terminate()
    server.wait(timeout=10)

    ok = all(w.returncode == 0 and "OK" in o for w, o in zip(workers, outs))
    p99 = [float(m.group(1)) for o in outs for m in [re.search(r"p99_ms ([0-9.]+)", o)] if m]
    warm = [s for s in samples if s[0] >= 10] or samples
    rss = [s[1] for s in warm]
    fds = [s[2] for s in warm]
    shm = [s[3] for s in samples]
    print(f"clients {args.clients} x {args.steps} steps in {elapsed:.0f} s; all bitwise equal to their reference: {ok}")
    for o in outs:
        print("  " + o.strip().splitlines()[-1])
    print(f"server requests {st['requests']}, errors {st['errors']}, step items {st['step_items']}, "
          f"server step p50 {st['step_us_p50']} us, p99 {st['step_us_p99']} us")
    print(f"client round-trip p99 per client (ms): {', '.join(f'{x:.2f}' for x in p99)}")
    print(f"server RSS after 10 s: first {rss[0] / 2**20:.1f} MiB, median {statistics.median(rss) / 2**20:.1f} MiB, "
          f"max {max(rss) / 2**20:.1f} MiB, last {rss[-1] / 2**20:.1f} MiB")
    print(f"server open fds: first {fds[0]}, max {max(fds)}, last {fds[-1]}; after all clients left: {final[1]}")
    print(f"sonar-* shared-memory objects: max {max(shm)} during the run, {final[2]} after")
    print(f"sessions/tensors/segments left on the server: {st['sessions']}/{st['tensors']}/{st['segments']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
