"""Kernel benchmarks on the torch side: torch CPU AdamW (single-tensor, foreach, fused), torch's
copy bandwidth, and sonard end to end (one tensor per request, from Python). Prints JSON.

    python bench/kernel.py --sizes 1M,16M,64M --reps 7
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import common
import torch
from torch import nn

VARIANTS: dict[str, dict[str, Any]] = {
    "single": dict(foreach=False),  # the CPU default: _single_tensor_adam
    "foreach": dict(foreach=True),
    "fused": dict(fused=True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_sizes(s: str) -> list[int]:
    out = []
    for f in s.split(","):
        f = f.strip()
        mult = 1 << 20 if f.endswith("M") else 1 << 10 if f.endswith("K") else 1
        out.append(int(f.rstrip("MK")) * mult)
    return out


def default_path() -> str:
    """Which AdamW implementation torch picks on CPU when neither foreach nor fused is given."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    fused, foreach = _default_to_fused_or_foreach([torch.zeros(4)], differentiable=False, use_fused=False)
    return "fused" if fused else "foreach" if foreach else "single"


def copy_bandwidth(mb: int, reps: int) -> dict:
    n = mb << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    med = common.median(times)
    return {"bytes": n, "threads": torch.get_num_threads(), "median_s": med, "times_s": times,
            "gb_per_s_read_write": 2 * n / med / 1e9}


def make(n: int, dtype: torch.dtype, seed: int) -> tuple[nn.Parameter, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter((torch.randn(n, generator=g) * 0.02).to(dtype))
    grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
    return p, grad


def torch_adamw(n: int, dtype: torch.dtype, reps: int, variants: tuple[str, ...] = tuple(VARIANTS)) -> list[dict]:
    """The variants on equal tensors, timed round-robin (so load drift hits all alike)."""
    runs: dict[str, tuple[torch.optim.AdamW, list[float]]] = {}
    for name in variants:
        kw = VARIANTS[name]
        p, grad = make(n, dtype, 1)
        p.grad = grad
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
        opt.step()  # warm-up: allocates the state, step 1
        runs[name] = (opt, [])
    for _ in range(reps):
        for name, (opt, times) in runs.items():
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    bpe = 7 * torch.finfo(dtype).bits // 8
    out = []
    for name, (opt, times) in runs.items():
        med = common.median(times)
        out.append({"impl": f"torch-{name}", "dtype": str(dtype).removeprefix("torch."), "numel": n,
                    "threads": torch.get_num_threads(), "median_s": med, "min_s": min(times), "times_s": times,
                    "elements_per_s": n / med, "gb_per_s": n * bpe / med / 1e9, "bytes_per_element": bpe})
    del runs
    return out


def sonard_e2e(n: int, dtype: torch.dtype, reps: int, fused: bool = False, ping_baseline: bool = False) -> dict:
    """One expert tensor of n elements updated by a private sonard: request latency seen by
    the client (send -> reply handled) and the server's own time for the step. With
    ping_baseline, each step alternates with a ``ping`` on a second connection to the same
    server sent from the same place: right after an equal backward on a plain tensor, so it
    waits after the same idle gap (the baseline of what a step costs beyond a request)."""
    import sonar_moe
    from sonar_moe import Connection
    p, grad = make(n, dtype, 1)
    w = grad.clone()
    q = p.detach().clone().requires_grad_(True)
    pings: list[float] = []
    with sonar_moe.SonarAdamW([("experts.w", p)], lr=1e-3, weight_decay=0.01, fused=fused or None,
                              expert_params=lambda name, t: True) as opt:
        other = Connection(opt.server_address, timeout=30) if ping_baseline and opt.server_address else None
        walls = []
        for i in range(reps + 1):
            (p * w).sum().backward()  # the hook hands the gradient over (zero copy) and sends the request
            t = time.perf_counter()
            opt.step()  # waits for the reply
            if i:
                walls.append(time.perf_counter() - t)
            if other is not None:
                (q * w).sum().backward()
                q.grad = None
                t = time.perf_counter()
                other.call("ping", {})
                if i:
                    pings.append(time.perf_counter() - t)
        if other is not None:
            other.close()
        lat = opt.request_latencies[-reps:]  # one latency per request
        st = opt.stats()
        srv = st["server"]
    med = common.median(lat)
    bpe = 7 * torch.finfo(dtype).bits // 8
    out = {"impl": "sonard-e2e-fused" if fused else "sonard-e2e", "arithmetic": "fused" if fused else "single",
           "dtype": str(dtype).removeprefix("torch."), "numel": n,
           "median_s": med, "min_s": min(lat), "times_s": lat, "elements_per_s": n / med,
           "gb_per_s": n * bpe / med / 1e9, "bytes_per_element": bpe,
           "server_step_us_p50": srv.get("step_us_p50"), "server_step_us_p99": srv.get("step_us_p99"),
           "wait_in_step_s": common.median(walls)}
    if pings:
        out["ping_after_backward_s"] = common.median(pings)
        out["ping_after_backward_times_s"] = pings
    return out


def _stats(times: list[float]) -> dict:
    t = sorted(times)
    n = len(t)
    return {"n": n, "p50_s": t[n // 2], "p90_s": t[n * 9 // 10], "p99_s": t[n * 99 // 100], "max_s": t[-1],
            "times_s": times}


IDLE_GAPS_S = (0.001, 0.005)


def ipc_ping(n: int, go_bench: str | None = None, cross_cpu: int | None = None) -> dict:
    """Round trips of a request the server answers without doing anything ("ping"),
    as SonarAdamW makes them (``Connection.call``), and where their microseconds go: the same
    request sent with bare pyzmq + msgpack (no sonar_moe client code), and (with go_bench) a
    bare ZeroMQ ROUTER echo in Go (no decoding, no handler: the transport's floor) and a plain
    Unix seqpacket echo in Go (no ZeroMQ: the machine's floor). They
    are measured in interleaved rounds, so a change of the machine's load hits all alike. The
    client's CPU time per call (this process, all threads) is reported beside the wall time.
    With cross_cpu (the caller pinned to one CPU, see one_core), one more Unix echo runs pinned to
    that other CPU: the same path, but every hand-over crosses between two virtual CPUs."""
    import socket
    import tempfile

    import msgpack
    import zmq
    from sonar_moe import PROTOCOL_VERSION, start_private_server

    conn = start_private_server(timeout=10.0, transport="zmq")  # as SonarAdamW starts one
    # The same client code over sonard's own Unix socket (unix://): no ZeroMQ I/O threads.
    conn_unix = start_private_server(timeout=10.0, transport="unix")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(conn.address)
    tmp = tempfile.mkdtemp(prefix="sonar-echo-")
    servers: list[subprocess.Popen[str]] = []
    echo, unix, cross = None, None, None

    def serve(flag: str, where: str, cpu: int | None = None) -> None:
        """Start a sonar-bench echo (on one CPU if told) and wait until it listens."""
        assert go_bench is not None  # called only when the Go benchmark binary was built
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        proc = subprocess.Popen([go_bench, flag, where], stdout=subprocess.PIPE, text=True, preexec_fn=pin)
        servers.append(proc)
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready"

    def unix_echo(path: str, cpu: int | None = None) -> socket.socket:
        """A plain Unix seqpacket echo at path (on one CPU if told), connected."""
        serve("-unix-echo", path, cpu)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        return sock

    if go_bench:
        addr = f"ipc://{tmp}/echo.sock"
        serve("-echo", addr)
        echo = ctx.socket(zmq.DEALER)
        echo.setsockopt(zmq.LINGER, 0)
        echo.connect(addr)
        # The machine's floor: the same Go process kind and client, a plain Unix socket, no ZeroMQ.
        unix = unix_echo(f"{tmp}/echo.unix")
        if cross_cpu is not None:
            cross = unix_echo(f"{tmp}/cross.unix", cross_cpu)
    req = msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1, "body": {}}, use_bin_type=True)

    def via_client() -> None:
        conn.call("ping", {})

    def via_client_unix() -> None:
        conn_unix.call("ping", {})

    def via_pyzmq() -> None:
        raw.send(req)
        msgpack.unpackb(raw.recv(), raw=False)

    def via_echo() -> None:
        assert echo is not None
        echo.send(req)
        msgpack.unpackb(echo.recv(), raw=False)

    def over_unix(sock: socket.socket) -> Callable[[], None]:
        def via_unix() -> None:
            sock.send(req)
            msgpack.unpackb(sock.recv(1 << 16), raw=False)
        return via_unix

    cases = {"client": via_client, "client_unix": via_client_unix, "pyzmq": via_pyzmq}
    if echo is not None:
        cases["echo"] = via_echo
    if unix is not None:
        cases["unix"] = over_unix(unix)
    if cross is not None:
        cases["unix_cross"] = over_unix(cross)
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, float] = {k: 0.0 for k in cases}
    gapped: dict[float, dict[str, list[float]]] = {}
    try:
        for f in cases.values():
            for _ in range(50):
                f()
        rounds = 10
        for _ in range(rounds):
            for k, f in cases.items():
                c0 = time.process_time()
                for _ in range(max(1, n // rounds)):
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
                cpu[k] += time.process_time() - c0
        # The same round trips after an idle gap, as in training, where requests come between
        # stretches of backward: every thread on the path has gone to sleep (and, on a virtual
        # machine, its virtual CPU may have halted), so each hand-over is a wake-up.
        for gap in IDLE_GAPS_S:
            for _ in range(max(20, n // 10)):
                for k, f in cases.items():
                    time.sleep(gap)
                    t = time.perf_counter()
                    f()
                    gapped.setdefault(gap, {}).setdefault(k, []).append(time.perf_counter() - t)
    finally:
        raw.close()
        if echo is not None:
            echo.close()
        if unix is not None:
            unix.close()
        if cross is not None:
            cross.close()
        for proc in servers:
            proc.kill()
            proc.wait()
        conn.shutdown()
        conn_unix.shutdown()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    out = {**_stats(times["client"]), "cpu_s_per_call": cpu["client"] / len(times["client"]),
           "layers": {k: {**_stats(v), "cpu_s_per_call": cpu[k] / len(v)} for k, v in times.items()},
           "after_idle": [{"gap_s": gap, "layers": {k: _stats(v) for k, v in by.items()}} for gap, by in gapped.items()]}
    # msgpack's share on the client: one request packed and one reply unpacked.
    rep = msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "ok": True, "body": {"requests": 1}}, use_bin_type=True)
    m = 20000
    t = time.perf_counter()
    for _ in range(m):
        msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1, "body": {}}, use_bin_type=True)
        msgpack.unpackb(rep, raw=False)
    out["msgpack_s_per_call"] = (time.perf_counter() - t) / m
    return out


def run_go_bench(go_bench: str, *args: str) -> dict:
    """One run of cmd/sonar-bench with args; its JSON report."""
    return json.loads(subprocess.run([go_bench, *args], check=True, stdout=subprocess.PIPE).stdout)


def go_engine(go_bench: str, lib: str | None, dtype: str, n: int, reps: int) -> list[dict]:
    """The Go engine in-process (cmd/sonar-bench): single-tensor arithmetic with the IEEE sqrt and
    (float32) MKL vmsSqrt, and the fused arithmetic."""
    args = ["-sizes", str(n), "-dtypes", dtype, "-reps", str(reps), "-copy-mb", "256", "-fused",
            "-stream-m", str(max(1, (n if dtype == "float32" else n // 2) >> 20))]  # the same bytes as the case
    if lib:
        args += ["-torch-lib", lib]
    out = run_go_bench(go_bench, *args)
    copies = [c["gb_per_s_read_write"] for c in out["copy"]]  # right before and after the kernels
    # AdamW's own access pattern (4 read + 3 write streams) at this size, before and after.
    streams = [st["gb_per_s"] for st in out.get("stream", [])]
    isa = {"isa": out.get("isa", ""), "cpu_isa": out.get("cpu_isa", "")}  # the vector instructions the kernels ran
    return [{**k, **isa, "copies_gbps": copies, "streams_gbps": streams} for k in out["kernels"]]


def contended(go_bench: str, n: int, reps: int, rounds: int = 3) -> dict:
    """The kernels while another process keeps one core busy (a busy loop), as on a shared machine
    or beside a trainer's own threads: torch's AdamW, and the Go engine with its default chunking
    (several chunks per worker from a shared counter) and with one fixed chunk per worker (the
    engine before 2026-12-01: the worker that shares a core finishes last and the others wait).
    Interleaved rounds of each, medians over all repeats."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        times: dict[tuple[str, str, int], list[float]] = {}
        for _ in range(rounds):
            for dn in ("float32", "bfloat16"):
                dtype = DTYPES[dn]
                for r in torch_adamw(n, dtype, reps, ("single", "fused")):
                    times.setdefault((r["impl"], dn, 0), []).extend(r["times_s"])
                for chunks in (1, 0):
                    out = run_go_bench(go_bench, "-sizes", str(n), "-dtypes", dn, "-reps", str(reps), "-copy-mb", "0",
                                       "-fused", "-chunks", str(chunks))
                    for k in out["kernels"]:
                        times.setdefault((f"go-{k['impl']}", dn, chunks), []).extend(k["times_s"])
    finally:
        busy.kill()
        busy.wait()
    rows = [{"impl": impl, "dtype": dn, "chunks_per_worker": chunks, "numel": n, "median_s": common.median(t),
             "times_s": t} for (impl, dn, chunks), t in times.items()]
    return {"numel": n, "busy_processes": 1, "rows": rows}


def go_copy(go_bench: str, mb: int, reps: int) -> dict:
    return run_go_bench(go_bench, "-sizes", "", "-copy-mb", str(mb), "-reps", str(reps))["copy"][0]


def merge(blocks: list[list[dict]]) -> list[dict]:
    """Several runs of the same cases (blocks of repeats taken at different times): one row per
    case, its statistics over all the repeats (and, for the Go engine's, all the copy and stream
    measurements around them)."""
    out = []
    for rows in zip(*blocks):
        x = rows[0]
        times = [t for r in rows for t in r["times_s"]]
        med = common.median(times)
        row = {**x, "times_s": times, "median_s": med, "min_s": min(times), "elements_per_s": x["numel"] / med,
               "gb_per_s": x["numel"] * x["bytes_per_element"] / med / 1e9}
        if "copies_gbps" in x:
            copies = [c for r in rows for c in r["copies_gbps"]]
            streams = [st for r in rows for st in r.get("streams_gbps", [])]
            row.update({"copies_gbps": copies, "copy_gbps": common.median(copies), "streams_gbps": streams,
                        "stream_gbps": common.median(streams) if streams else None})
        out.append(row)
    return out


# torch's repeats of a case and the Go engine's alternate in this many rounds (the Go engine
# before the first and after each), so that a change of the shared machine's speed, which can
# last seconds, falls on both alike: with one block of each, one run found torch's fused step at
# 64M elements 1.7x faster than the bandwidth measured beside it, and no such rate again.
ROUNDS = 3


def one_core(pings: int, go_bench: str | None) -> dict | None:
    """The ping and small-step measurements again with this process, sonard and the echo servers
    all on one CPU (a child process pinned before it starts anything; children inherit it), and
    a Unix echo pinned to another CPU beside them. On a virtual machine, waking a thread on
    another virtual CPU that has halted is a trip through the host; on one CPU every hand-over
    is a plain context switch. Comparing the two shows what the software costs and what the
    placement costs. None on a one-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cmd = [sys.executable, __file__, "--transport-only", "--pings", str(pings), "--cross-cpu", str(cpus[1])]
    if go_bench:
        cmd += ["--go-bench", go_bench]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))
    out = json.loads(proc.stdout)
    out["cpu"], out["other_cpu"] = cpus[0], cpus[1]
    return out


FLOORS = ("echo", "unix", "unix_cross")


def transport(pings: int, go_bench: str | None, cross_cpu: int | None = None, apart: bool = False) -> dict:
    """The bare round trip (ipc_ping) and a step request whose kernel is negligible (64 elements):
    what a step costs beyond a request. With apart, sonard's paths and the echo floors are
    measured in two runs instead of interleaved: on one CPU, an echo server's Go runtime, busy
    from its own batch, took the CPU from the batch after it (the client's round trip measured
    53-70 us beside the echo servers, 33-34 us without them, 2026-12-02)."""
    ping = ipc_ping(pings, None if apart else go_bench, None if apart else cross_cpu)
    if apart and go_bench:
        floors = ipc_ping(pings, go_bench, cross_cpu)
        ping["layers"].update({k: v for k, v in floors["layers"].items() if k in FLOORS})
        for mine, theirs in zip(ping["after_idle"], floors["after_idle"]):
            mine["layers"].update({k: v for k, v in theirs["layers"].items() if k in FLOORS})
    out = {"ping": ping, "step_small": sonard_e2e(64, torch.float32, max(50, pings // 4), ping_baseline=True)}
    # The same over sonard's own Unix socket (the private server SonarAdamW starts with
    # SONAR_TRANSPORT=unix; the baseline ping's connection goes to that server, the same way).
    with common.environ({"SONAR_TRANSPORT": "unix"}):
        out["step_small_unix"] = sonard_e2e(64, torch.float32, max(50, pings // 4), ping_baseline=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copy-mb", type=int, default=256)
    ap.add_argument("--no-sonard", action="store_true")
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--go-bench", help="cmd/sonar-bench binary: measure the Go engine next to each torch case")
    ap.add_argument("--go-bench-before", help="a cmd/sonar-bench built from an earlier commit: its Go engine "
                    "measured beside --go-bench's at each case (around each of its runs)")
    ap.add_argument("--torch-lib", help="libtorch_cpu.so for the Go engine's MKL sqrt variant")
    ap.add_argument("--contended", default="", help="size (K/M suffix) of the kernels also timed with one core "
                    "kept busy by another process (needs --go-bench); empty: not")
    ap.add_argument("--transport-only", action="store_true",
                    help="only the ping and small-step measurements (one_core runs this pinned to one CPU)")
    ap.add_argument("--cross-cpu", type=int, help="with --transport-only: a CPU for one more Unix echo")
    a = ap.parse_args()
    if a.transport_only:
        print(json.dumps(transport(a.pings, a.go_bench, a.cross_cpu, apart=True)))
        return
    res: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                 "capability": torch.backends.cpu.get_cpu_capability(), "default_path": default_path(),
                 "copy": [copy_bandwidth(a.copy_mb, a.reps)], "kernels": [], "sonard": []}
    if a.go_bench:
        res["go_copy"] = [go_copy(a.go_bench, a.copy_mb, a.reps)]
        res["go_kernels"] = []
        res["divider"] = run_go_bench(a.go_bench, "-sizes", "", "-copy-mb", "0", "-divider").get("divider")
    before = a.go_bench_before if a.go_bench else None
    if before:
        res["go_kernels_before"] = []
    per_round = max(1, -(-a.reps // ROUNDS))  # torch's repeats of a case, in ROUNDS blocks
    res["rounds"] = ROUNDS
    for dn in a.dtypes.split(","):
        dtype = DTYPES[dn.strip()]
        for n in parse_sizes(a.sizes):
            # The Go engine before torch's first block and after each (the earlier build, if any,
            # around those), so drift of the machine's load hits both alike.
            def go_block(mine: list[list[dict]], old: list[list[dict]]) -> None:
                if before:
                    old.append(go_engine(before, a.torch_lib, dn.strip(), n, per_round))
                if a.go_bench:
                    mine.append(go_engine(a.go_bench, a.torch_lib, dn.strip(), n, per_round))
            go_blocks: list[list[dict]] = []
            old_blocks: list[list[dict]] = []
            torch_blocks: list[list[dict]] = []
            go_block(go_blocks, old_blocks)
            for _ in range(ROUNDS):
                torch_blocks.append(torch_adamw(n, dtype, per_round))
                go_block(go_blocks, old_blocks)
            res["kernels"] += merge(torch_blocks)
            if a.go_bench:
                res["go_kernels"] += merge(go_blocks)
            if before:
                res["go_kernels_before"] += merge(old_blocks)
            if not a.no_sonard:
                res["sonard"].append(sonard_e2e(n, dtype, a.reps))
                res["sonard"].append(sonard_e2e(n, dtype, a.reps, fused=True))
    if not a.no_sonard:
        res.update(transport(a.pings, a.go_bench))
        res["one_core"] = one_core(a.pings, a.go_bench)
    if a.contended and a.go_bench:
        res["contended"] = contended(a.go_bench, parse_sizes(a.contended)[0], a.reps)
    res["copy"].append(copy_bandwidth(a.copy_mb, a.reps))
    if a.go_bench:
        res["go_copy"].append(go_copy(a.go_bench, a.copy_mb, a.reps))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
