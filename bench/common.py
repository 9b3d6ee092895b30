"""Shared helpers of the benchmark suite: paths, timing, machine description."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "examples", ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def load_avg() -> tuple[float, float, float]:
    return os.getloadavg()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def last_level_cache_mib() -> float | None:
    """The size of CPU 0's last-level cache in MiB, as the (virtual) machine reports it, or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        sizes = []
        for d in sorted(os.listdir(base)):
            if d.startswith("index"):
                with open(f"{base}/{d}/size") as f:
                    text = f.read().strip()
                unit = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(text[-1:], 1 / 2**20)
                sizes.append(float(text.rstrip("KMG")) * unit)
        return max(sizes) if sizes else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def environ(changes: dict[str, str]) -> Iterator[None]:
    """os.environ with changes for the duration (what a private sonard or SonarAdamW reads when
    it starts), restored after."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_idle() -> dict:
    """How an idle CPU waits (Linux cpuidle): the driver and, for a virtual machine's haltpoll
    driver, how long an idle virtual CPU polls before it halts (0: it halts at once, and waking
    it goes through the host). Entries the machine does not have are left out."""
    out = {"driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
           "guest_halt_poll_ns": _read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")}
    return {k: v for k, v in out.items() if v is not None}


def halt_polling_applies(idle: dict) -> bool:
    """Whether guest_halt_poll_ns decides how an idle CPU waits: only under the haltpoll cpuidle
    driver. With no driver (`none`) the kernel's default idle halts the CPU at once whatever the
    parameter says (the haltpoll module may still be loaded and show it)."""
    return idle.get("driver") == "haltpoll" and "guest_halt_poll_ns" in idle


def idle_wait_phrase(idle: dict) -> str | None:
    """How an idle (virtual) CPU of this machine waits, in words, or None where unknown."""
    if halt_polling_applies(idle):
        ns = int(idle["guest_halt_poll_ns"])
        if ns == 0:
            return "an idle virtual CPU here halts at once (`guest_halt_poll_ns` 0)"
        return f"an idle virtual CPU here polls {ns / 1000:.0f} us before it halts (`guest_halt_poll_ns` {ns})"
    if idle.get("driver") == "none":
        return "an idle CPU here halts at once (no cpuidle driver: the kernel's default idle)"
    return None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def mem_total_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmHWM/VmRSS/RssAnon/RssShmem of a process, in bytes."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat; clock-tick resolution)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_switches(pid: int, voluntary_only: bool = False) -> int:
    """Context switches (voluntary and not) a process's threads have made so far, -1 where unreadable.
    On these virtual machines each is a wake-up, and where a virtual CPU had halted, a dear one.
    voluntary_only: only the threads' own sleeps, not their preemptions (which other processes'
    load adds)."""
    fields = ("voluntary_ctxt_switches:",) + (() if voluntary_only else ("nonvoluntary_ctxt_switches:",))
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return -1
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[-1]) for line in f if line.startswith(fields))
        except OSError:  # the thread exited
            pass
    return total


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_json(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> Any:
    """Run a command that prints one JSON document on stdout; stderr passes through."""
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, env=env, timeout=timeout, cwd=ROOT).stdout
    print(f"  ({time.perf_counter() - t:.0f} s) {' '.join(Path(c).name if os.sep in c else c for c in cmd[:3])} ...",
          file=sys.stderr, flush=True)
    return json.loads(out)


def torch_lib() -> str:
    import torch
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"
