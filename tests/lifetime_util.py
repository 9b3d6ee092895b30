"""Helpers of the lifetime tests: a tiny trainer run as a separate process, and process checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A trainer: a tiny model with one batched expert tensor, one step, then whatever END says.
TRAINER = r'''
import os, signal, sys, threading, time
sys.path.insert(0, os.environ["SONAR_PYCLIENT"])
import torch
from torch import nn
import sonar_moe

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 8, 6))
        self.lin = nn.Linear(6, 6)

    def loss(self):
        return self.experts.gate_up_proj.square().sum() + self.lin.weight.sum()

def build(server=None):
    m = Tiny()
    return m, sonar_moe.SonarAdamW(m, lr=1e-3, server=server)

def train(m, opt, steps=1):
    for _ in range(steps):
        m.loss().backward()
        opt.step()
        opt.zero_grad()

how = sys.argv[1]
server = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
if how == "thread":
    # SonarAdamW built in a thread that ends: the parent-death signal fires for the thread,
    # the server must stay; the trainer then trains from its main thread.
    box = {}
    t = threading.Thread(target=lambda: box.update(zip(("m", "opt"), build(server))))
    t.start(); t.join()
    m, opt = box["m"], box["opt"]
    time.sleep(1.5)
    train(m, opt, 2)
else:
    m, opt = build(server)
    train(m, opt)
pid = opt.server_process.pid if opt.server_process is not None else 0
print(f"READY {pid}", flush=True)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
elif how in ("sigkill", "thread"):
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "exit":
    os._exit(3)
elif how == "wait":
    sys.stdin.readline()
time.sleep(60)
'''


def trainer(how: str, server: str = "-", **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "SONAR_PYCLIENT": str(ROOT / "pyclient")}
    return subprocess.Popen([sys.executable, "-c", TRAINER, how, server], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, env=env, **kw)  # type: ignore[call-overload]


def ready_pid(p: subprocess.Popen[str], timeout: float = 120) -> int:
    """The server pid the trainer printed once it trained a step."""
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.startswith("READY"):
            return int(line.split()[1])
        if not line and p.poll() is not None:
            raise AssertionError(f"trainer exited with {p.returncode} before READY")
    raise AssertionError("trainer not ready")


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> float:
    """Seconds until pid ended; raises if it still runs after timeout."""
    t0 = time.monotonic()
    while running(pid):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"process {pid} still runs after {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - t0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop(pid: int) -> None:
    """SIGSTOP pid and wait until every thread of it has stopped (the signal is not
    synchronous: a thread woken by a request just sent could still answer it)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
            states.append(stat[stat.rfind(b")") + 2:][:1])
        if all(s in (b"T", b"t") for s in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")
