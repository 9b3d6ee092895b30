"""GPU check of Sonar-MoE's CUDA path: the real sonard, the real client (scripts/gpu-check run).

One prepared run of at most 8 minutes on a machine with an NVIDIA GPU. It writes
docs/gpu-results.md and docs/gpu-results.json (and copies both to $OUT when that is set):

0. ipc: in its first seconds, whether cross-process CUDA IPC works here at all. A second
   Python process opens a tensor of this one by its memory handle (torch's own sharing, as
   torch.multiprocessing does), waits on this process's interprocess event while this process
   has slow work queued before an update, and writes into the tensor. gVisor may refuse this;
   without it every check that needs sonard is reported NOT-POSSIBLE with the reason, and the
   checks that need no second process (the kernels, the standard baseline) still run.
   sonard-start: sonard's own start with the GPU (driver, NVRTC compile): its CUDA log lines.
1. kernel: the CUDA AdamW kernels (through `sonar-kernelcheck files`) against
   torch.optim.AdamW on CUDA, foreach (its default) and fused=True, float32 and bfloat16, six
   option sets (parameter groups of one optimizer), odd sizes (1 ... 1,048,581 elements), 3
   steps, bit for bit, counted per option set; the Go reference of each arithmetic is compared
   too, so a mismatch says whether the assumed rounding or the kernel is wrong. Each case runs
   the kernels as sonard builds them by default (scalar loads, one element at a time) and with
   vector loads (`sonard --cuda-loads vector`: 16 bytes a thread and array where the arrays are
   16-byte aligned); every third tensor's gradient sits one element off a 16-byte boundary, so
   the one-element path runs on whole tensors too.
2. sonard: a small OLMoE (transformers, on CUDA) trained by sonar_moe.SonarAdamW with a
   private sonard (started by the client, as a user gets it), float32 and bfloat16, with and
   without max_grad_norm, and with fused=True (float32, and bfloat16 with clipping), and two of
   these again with sonard's vector-load kernels (SONAR_CUDA_LOADS=vector), bit for
   bit against torch.optim.AdamW (with the same flags) over all parameters: (a) a
   shadow AdamW fed the very gradients of the Sonar run, after every step; (b) an independent
   torch run (meaningful when two torch runs agree); (c) state_dict() (sonard's export) vs
   the shadow's state; (d) load_state_dict() of torch's state into a fresh SonarAdamW (sonard's
   import), then one more step.
3. full: OLMoE-1B-7B's configuration (random init, bf16): standard AdamW with global clipping
   vs SonarAdamW (dense clipped) with the real sonard, with its default kernels and with vector
   loads (SONAR_CUDA_LOADS=vector): peak memory (torch's allocator peak +
   sonard's device memory incl. its CUDA context, measured as the device's used memory growth
   outside torch's allocator, cross-checked by NVML per process where it answers) and median
   step time, against the paper's -19..22% memory and -17..23% step time.
4. bench: kernel throughput on one OLMoE layer's experts (vector and scalar loads in alternating
   rounds), foreach against torch's foreach AdamW and fused against AdamW(fused=True).
5. cpu-kernels: the CPU update kernels at every vector level the host CPU has (AVX-512 where
   it has it; this repository's own machines lack it), lane for lane against the Go code
   (the optimizer package's tests, built by `scripts/gpu-check prepare`).

`--cpu-selftest` runs the sonard and full checks' harness on the CPU (shared-memory path, tiny
config): a test of this script, not of the GPU path. Without a GPU the script writes a report
that says so and exits 0.
"""

from __future__ import annotations

import os

# Before torch initializes CUDA: deterministic cuBLAS for the bitwise end-to-end checks, and
# no expandable segments (their memory cannot be shared by IPC handle, so Sonar refuses it;
# both sides of the memory comparison must then run with the same allocator settings).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
ALLOC_NOTES: list[str] = []
for _var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    _conf = os.environ.get(_var, "")
    if "expandable_segments" in _conf:
        _kept = ",".join(p for p in _conf.split(",") if p.strip() and not p.strip().startswith("expandable_segments"))
        if _kept:
            os.environ[_var] = _kept
        else:
            del os.environ[_var]
        ALLOC_NOTES.append(f"{_var} was {_conf!r}: expandable segments turned off for this run")

import argparse  # noqa: E402
import base64  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import re  # noqa: E402
import platform  # noqa: E402
import queue  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Callable  # noqa: E402

import torch  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class G:
    """Run-wide state."""

    start = time.monotonic()
    deadline = start + 440.0  # the whole run's budget
    check_deadline = deadline  # the current check's
    current = ""  # the check running now (for the watchdog)
    out = Path("docs/gpu-results.md")
    env: dict[str, Any] = {}
    # ok: everything the probe checks is right; usable: a second process could open the memory
    ipc: dict[str, Any] = {"ok": None, "usable": None, "summary": "not probed"}
    dev = "cuda"
    selftest = False
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    wrote_final = False


def left() -> float:
    """Seconds left for the current check."""
    return G.check_deadline - time.monotonic()


def record(name: str, status: str, detail: str, **extra: Any) -> None:
    with G.lock:
        G.results.append({"check": name, "status": status, "detail": detail, **extra})
    print(f"[{status}] {name}: {detail}", flush=True)


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:600]}"


def err_where(e: BaseException) -> str:
    """The error and where it was raised: this script's innermost line and the innermost line."""
    tb = traceback.extract_tb(e.__traceback__)
    mine = [f for f in tb if f.filename == __file__]
    spots = [f"{Path(f.filename).name}:{f.lineno}" for f in (mine[-1:] + tb[-1:])]
    return err_text(e) + " (at " + " < ".join(dict.fromkeys(reversed(spots))) + ")"


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    return int((bits(a) != bits(b.to(a.device))).sum())


def dtname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync() -> None:
    if G.dev == "cuda":
        torch.cuda.synchronize()


class LineProc:
    """A child process whose stdout lines are read by a thread (so reads can time out)."""

    def __init__(self, argv: list[str], **kw: Any) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, **kw)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line; None at end of output. Raises TimeoutError."""
        try:
            line = self.lines.get(timeout=max(0.1, timeout))
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout:.0f} s") from None
        if line is not None:
            self.log.append(line)
        return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, grace: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


# ------------------------------------------------------------------------------- 0. ipc probe
# The second process of the probe. It speaks JSON lines on stdout; the parent drives it on stdin.
PROBE_CHILD = r"""
import base64, json, pickle, sys, time
def say(**kw):
    print(json.dumps(kw), flush=True)
stage = "import torch"
try:
    t0 = time.perf_counter()
    import torch
    stage = "CUDA init"
    torch.zeros(1, device="cuda")
    say(stage="ready", init_s=time.perf_counter() - t0)
    msg = pickle.loads(base64.b64decode(sys.stdin.readline()))
    stage = "open the memory handle"
    fn, args = msg["small"]
    t = time.perf_counter()
    x = fn(*args)
    torch.cuda.synchronize()
    open_s = time.perf_counter() - t
    n = x.numel()
    initial_ok = bool(torch.equal(x, torch.arange(n, dtype=x.dtype, device=x.device)))
    stage = "open a 512 MiB block"
    fn, args = msg["big"]
    t = time.perf_counter()
    big = fn(*args)
    torch.cuda.synchronize()
    big_s = time.perf_counter() - t
    stage = "open the event handle"
    ev = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), msg["event"])
    say(stage="opened", open_s=open_s, big_open_s=big_s, big_bytes=big.numel() * big.element_size(), initial_ok=initial_ok)
    sys.stdin.readline()
    stage = "wait on the event"
    t = time.perf_counter()
    ev.wait(torch.cuda.current_stream())
    after = x.clone()
    torch.cuda.synchronize()
    waited = time.perf_counter() - t
    event_ok = bool(torch.equal(after, torch.arange(n, dtype=x.dtype, device=x.device) + 1))
    seen_old = bool(torch.equal(after, torch.arange(n, dtype=x.dtype, device=x.device)))
    stage = "write into the shared tensor"
    x.mul_(2)
    torch.cuda.synchronize()
    say(stage="done", event_ok=event_ok, saw_old_values=seen_old, waited_s=waited)
except BaseException as e:
    say(stage="error", at=stage, error=f"{type(e).__name__}: {e}")
    sys.exit(1)
"""


def check_ipc(ctx: argparse.Namespace) -> None:
    name = "ipc (second process: memory handle + interprocess event)"
    child = None
    try:
        from torch.multiprocessing.reductions import reduce_tensor

        n = (1 << 20) + 3
        t = torch.arange(n, dtype=torch.float32, device="cuda")
        big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        ev = torch.cuda.Event(interprocess=True)
        ev.record()
        torch.cuda.synchronize()
        handle = bytes(t.untyped_storage()._share_cuda_()[1])
        G.ipc["torch_handle"] = f"{len(handle)} bytes, starts {handle[:2]!r}"
        msg = {"small": reduce_tensor(t), "big": reduce_tensor(big), "event": bytes(ev.ipc_handle())}
        child = LineProc([sys.executable, "-c", PROBE_CHILD])

        def expect(stage: str, timeout: float) -> dict[str, Any]:
            end = time.monotonic() + timeout
            while True:
                line = child.next_line(end - time.monotonic())
                if line is None:
                    raise RuntimeError(f"the second process exited ({child.proc.wait()}) before '{stage}': "
                                       + " | ".join(child.log[-5:]))
                try:
                    rep = json.loads(line)
                except ValueError:
                    continue  # a warning of torch's
                if rep.get("stage") == "error":
                    raise RuntimeError(f"second process, at '{rep.get('at')}': {rep.get('error')}")
                if rep.get("stage") == stage:
                    return rep

        ready = expect("ready", min(90.0, max(5.0, left())))
        child.send(base64.b64encode(pickle.dumps(msg)).decode())
        opened = expect("opened", 60)
        if not opened["initial_ok"]:
            raise RuntimeError("the second process opened the handle but read other values than this process wrote")
        # Slow work, then the update, then the event: no host synchronization in between. The
        # child waits on the event (on its GPU stream) and must see the update.
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        try:
            torch.cuda._sleep(int(4e8))
        except (AttributeError, RuntimeError):
            a = torch.randn(8192, 8192, device="cuda")
            for _ in range(40):
                a = a @ a
                a /= a.norm()
        s1.record()
        t.add_(1)
        ev.record()
        child.send("go")
        done = expect("done", 60)
        torch.cuda.synchronize()
        slow_ms = s0.elapsed_time(s1)
        writes_ok = bool(torch.equal(t, (torch.arange(n, dtype=torch.float32, device="cuda") + 1) * 2))
        child.proc.wait(timeout=30)
        G.ipc.update(ok=bool(done["event_ok"] and writes_ok), usable=True, open_ms=1e3 * opened["open_s"],
                     open_512mib_ms=1e3 * opened["big_open_s"], child_init_s=ready["init_s"],
                     event_wait_ms=1e3 * done["waited_s"], queued_slow_work_ms=slow_ms, event_ok=done["event_ok"],
                     saw_old_values=done["saw_old_values"], child_writes_visible=writes_ok)
        detail = (f"a second process opened a 4 MiB tensor by its IPC handle in {1e3 * opened['open_s']:.1f} ms "
                  f"(a 512 MiB block: {1e3 * opened['big_open_s']:.1f} ms, torch's rebuild incl. its ref counter and event); "
                  f"its stream waited on this process's interprocess event {1e3 * done['waited_s']:.0f} ms while "
                  f"{slow_ms:.0f} ms of work was queued before the update: "
                  + ("saw the update" if done["event_ok"] else
                     "did NOT see the update (" + ("old values" if done["saw_old_values"] else "other values") + ")")
                  + "; its writes " + ("are" if writes_ok else "are NOT") + " visible here; torch's handle "
                  + G.ipc["torch_handle"])
        if G.ipc["ok"]:
            G.ipc["summary"] = "memory handles and interprocess events work between two processes"
        else:  # handles open: sonard's checks still run (and will show what goes wrong)
            G.ipc["summary"] = "memory handles open in a second process, but not everything is right: " + detail
        record(name, "PASS" if G.ipc["ok"] else "FAIL", detail)
    except Exception as e:  # noqa: BLE001
        G.ipc.update(ok=False, usable=False, summary=f"a second process could not use this one's CUDA memory: {err_text(e)}")
        record(name, "NOT-POSSIBLE", f"cross-process CUDA IPC does not work here: {err_text(e)}")
    finally:
        if child is not None:
            child.stop(5)


def ipc_unavailable(what: str) -> bool:
    """Records `what` as not possible when cross-process IPC does not work here."""
    if G.ipc.get("usable") is False:
        record(what, "NOT-POSSIBLE", f"needs cross-process CUDA IPC, which does not work here: {G.ipc['summary']}")
        return True
    return False


# ---------------------------------------------------------------------------- sonard start
def check_sonard_start(ctx: argparse.Namespace) -> None:
    name = "sonard start (CUDA driver, NVRTC compile)"
    proc = None
    rundir = tempfile.mkdtemp(prefix="sonar-gpucheck-")
    try:
        import sonar_moe

        exe = sonar_moe.find_sonard()
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        G.env["sonard"] = (ver.stdout or ver.stderr).strip().splitlines()[0] if (ver.stdout or ver.stderr) else "?"
        t0 = time.monotonic()
        proc = LineProc([exe, "--listen", f"ipc://{rundir}/s.sock", "--log-level", "info", "--cuda-device", "0"])
        # sonard opens the GPU (driver, NVRTC compile, kernels) before it listens; it logs
        # "sonard listening" first and its "CUDA on"/"CUDA off" line right after.
        listening, cuda_seen, took = False, False, 0.0
        end = t0 + min(60.0, max(5.0, left()))
        while time.monotonic() < end:
            try:
                line = proc.next_line(end - time.monotonic())
            except TimeoutError:
                break
            if line is None:
                break
            if "listening" in line and not listening:
                listening, took = True, time.monotonic() - t0
                end = min(end, time.monotonic() + 5)  # the CUDA line follows at once
            if "CUDA on" in line or "CUDA off" in line:
                cuda_seen = True
            if listening and cuda_seen:
                break
        cuda_lines = [ln.strip() for ln in proc.log if "cuda" in ln.lower() or "nvrtc" in ln.lower()]
        on = any("CUDA on" in ln for ln in cuda_lines)
        rc = proc.proc.poll()
        detail = (f"{G.env['sonard']}; " + (f"listening {took:.1f} s after its start" if listening else
                                             f"not listening (exit status {rc})")
                  + "; " + (" | ".join(cuda_lines[:4]) or "no CUDA log line: " + " | ".join(proc.log[-3:])))
        record(name, "PASS" if listening and on else "FAIL", detail[:1200], start_s=took)
    except Exception as e:  # noqa: BLE001
        record(name, "ERROR", err_text(e))
    finally:
        if proc is not None:
            proc.stop(10)
        shutil.rmtree(rundir, ignore_errors=True)


# ----------------------------------------------------------------------------------- 1. kernel
# Odd sizes (tails of every kind, chunk boundaries of 65,536); the first option set also gets a
# tensor of 1,048,581 elements. Each option set is one parameter group of one torch.optim.AdamW.
KERNEL_SIZES = [1, 7, 4097, 65536 + 3, 300007]
KERNEL_BIG = (1 << 20) + 5
KERNEL_VARIANTS = {
    "default": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "no-decay": dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0),
    "amsgrad": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=True),
    "maximize": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=1e-2, maximize=True),
    "beta1=0.3": dict(lr=1e-3, betas=(0.3, 0.999), eps=1e-8, weight_decay=1e-2),
    "amsgrad+maximize": dict(lr=3e-2, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.1, amsgrad=True, maximize=True),
}
# torch's AdamW implementations on CUDA that sonard reproduces: the default (foreach,
# _multi_tensor_adam) and fused=True (_fused_adamw_: float from torch 2.11 on, partly double in
# 2.8-2.10). The fused kind this torch does not have is compared with the Go reference only.
# The kernels' memory access (sonar-kernelcheck -loads): sonard's default first.
KERNEL_LOADS = ("scalar", "vector")
KERNEL_IMPLS: dict[str, dict[str, Any]] = {"foreach": dict(foreach=True), "fused": dict(fused=True),
                                           "fused-double": dict(fused=True)}


def torch_fused_kind() -> str | None:
    """"fused" (torch >= 2.11), "fused-double" (2.8-2.10) or None: this torch's fused CUDA AdamW."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    v = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return "fused" if v >= (2, 11) else "fused-double" if v >= (2, 8) else None


def scalars(group: dict[str, Any], step: float) -> dict[str, Any]:
    """AdamW's per-step constants in Python float64, exactly as torch's adam.py computes them
    (the same values sonar_moe sends to sonard)."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    return {"decay": 1 - lr * wd, "apply_decay": wd != 0, "beta1_w": 1 - beta1, "beta2": beta2,
            "one_minus_beta2": 1 - beta2, "neg_step_size": -(lr / bc1), "bc2_sqrt": bc2**0.5,
            "eps": float(group["eps"]), "amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"])}


def fused_double_scalars(group: dict[str, Any], step: int) -> dict[str, Any]:
    """fused_scalars for torch 2.8-2.10's kernel: the bias corrections in double, from CUDA's double
    pow (1 - pow of float64 tensors on the GPU)."""
    sc = fused_scalars(group, step)
    dev_step = torch.tensor(float(step), dtype=torch.float64, device=G.dev)
    bc = [float((1 - torch.pow(torch.tensor(float(b), dtype=torch.float64, device=G.dev), dev_step)).item())
          for b in group["betas"]]
    sc.update(fused_double=True, bc1=bc[0], bc2=bc[1])
    return sc


def fused_scalars(group: dict[str, Any], step: int) -> dict[str, Any]:
    """The fused step's inputs (as sonar_moe.torch_fused_cuda_scalars sends them), and for the Go
    reference the bias corrections as torch's CUDA powf computes them (1 - pow of float32 tensors
    on the GPU: the same libdevice powf as the fused kernel's)."""
    sc = scalars(group, step)
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    dev_step = torch.tensor(float(step), dtype=torch.float32, device=G.dev)
    bc = [float((1 - torch.pow(torch.tensor(b, dtype=torch.float32, device=G.dev), dev_step)).item())
          for b in (beta1, beta2)]
    sc.update(decay=1 - lr * wd, beta1_w=1 - beta1, fused=True, lr=lr, beta1=beta1, weight_decay=wd, step=step,
              bc1=bc[0], bc2=bc[1])
    return sc


def check_kernel(ctx: argparse.Namespace, steps: int = 3) -> None:
    kc = ctx.kernelcheck
    if not (kc and os.access(kc, os.X_OK)):
        record("kernel", "ERROR", f"{kc or 'sonar-kernelcheck'} not found: `scripts/gpu-check prepare` builds it "
               "(scripts/build-go -o build/gpu --static sonar-kernelcheck)")
        return
    for loads in KERNEL_LOADS:
        for impl in KERNEL_IMPLS:
            for dtype in (torch.float32, torch.bfloat16):
                name = f"kernel {impl} {dtname(dtype)}" + ("" if loads == KERNEL_LOADS[0] else f" {loads} loads")
                if left() < 8:
                    record(name, "SKIPPED", "out of this check's time")
                    continue
                try:
                    with tempfile.TemporaryDirectory() as d:
                        _kernel_case(kc, Path(d), dtype, impl, steps, name, loads)
                except Exception as e:  # noqa: BLE001 - report and go on
                    record(name, "ERROR", err_text(e))


def _kernel_case(kc: str, d: Path, dtype: torch.dtype, impl: str, steps: int, name: str, loads: str) -> None:
    """One sonar-kernelcheck run: every option set of KERNEL_VARIANTS as a parameter group of one
    torch.optim.AdamW (foreach or fused), `steps` steps, compared per option set and state part."""
    import numpy as np

    g = torch.Generator(device=G.dev).manual_seed(1234)
    groups: list[tuple[str, dict[str, Any], list[torch.nn.Parameter]]] = []
    for vi, (vname, opts) in enumerate(KERNEL_VARIANTS.items()):
        sizes = KERNEL_SIZES + ([KERNEL_BIG] if vi == 0 else [])
        groups.append((vname, opts, [torch.nn.Parameter((torch.randn(n, device=G.dev, generator=g) * 0.05).to(dtype))
                                     for n in sizes]))
    params = [p for _, _, ps in groups for p in ps]
    grads = [[(torch.randn(p.numel(), device=G.dev, generator=g) * 10 ** (-3 + 2 * s)).to(dtype) for p in params]
             for s in range(steps)]
    amsgrad_of = [bool(opts.get("amsgrad", False)) for _, opts, ps in groups for _ in ps]
    for i, p in enumerate(params):
        bits(p).cpu().numpy().tofile(d / f"t{i}_p.bin")
        zero = torch.zeros_like(p).cpu()
        for part in ("m", "v") + (("vmax",) if amsgrad_of[i] else ()):
            bits(zero).numpy().tofile(d / f"t{i}_{part}.bin")
        for s in range(steps):
            bits(grads[s][i]).cpu().numpy().tofile(d / f"t{i}_g{s}.bin")
    opt = torch.optim.AdamW([dict(params=ps, **opts) for _, opts, ps in groups], **KERNEL_IMPLS[impl])
    step_scalars = {"foreach": scalars, "fused": fused_scalars, "fused-double": fused_double_scalars}[impl]
    # torch is the reference only for the implementations it has.
    vs_torch = impl == "foreach" or impl == torch_fused_kind()
    spec = {"dtype": dtname(dtype), "steps": steps,
            "tensors": [{"numel": p.numel(), "amsgrad": amsgrad_of[i]} for i, p in enumerate(params)],
            "scalars": [[step_scalars(group, s + 1) for group in opt.param_groups for _ in group["params"]]
                        for s in range(steps)]}
    (d / "spec.json").write_text(json.dumps(spec))
    for s in range(steps):
        for p, gr in zip(params, grads[s]):
            p.grad = gr.clone()
        if vs_torch:
            opt.step()
    out = subprocess.run([kc, "files", "-loads", loads, str(d)], capture_output=True, text=True,
                         timeout=max(10.0, min(60.0, left())))
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-600:])
    rep = json.loads(out.stdout)
    idt = np.int32 if dtype == torch.float32 else np.int16
    cases: dict[str, dict[str, Any]] = {}
    firsts: list[str] = []
    i = 0
    for vname, _, ps in groups:
        c = cases.setdefault(vname, {"values": 0, "kernel_vs_torch": 0, "reference_vs_torch": 0,
                                     "kernel_vs_reference": 0, "by_part": {}})
        for p in ps:
            parts = ["p", "m", "v"] + (["vmax"] if amsgrad_of[i] else [])
            if vs_torch:
                st = opt.state[p]
                torch_parts = {"p": p.detach(), "m": st["exp_avg"], "v": st["exp_avg_sq"]}
                if amsgrad_of[i]:
                    torch_parts["vmax"] = st["max_exp_avg_sq"]
            for part in parts:
                gpu = torch.from_numpy(np.fromfile(d / f"t{i}_{part}.gpu.bin", dtype=idt))
                ref = torch.from_numpy(np.fromfile(d / f"t{i}_{part}.ref.bin", dtype=idt))
                # Without torch's implementation the reference stands in for it.
                want = bits(torch_parts[part]).cpu() if vs_torch else ref
                bgr = int((gpu != ref).sum())
                bg, br = (int((gpu != want).sum()), int((ref != want).sum())) if vs_torch else (bgr, 0)
                c["values"] += gpu.numel()
                c["kernel_vs_torch"] += bg
                c["reference_vs_torch"] += br
                c["kernel_vs_reference"] += bgr
                c["by_part"][part] = c["by_part"].get(part, 0) + bg
                if bg and len(firsts) < 3:
                    j = int((gpu != want).nonzero()[0])
                    theirs = f"{int(want[j]) & 0xFFFFFFFF:#x}" if vs_torch else "-"
                    firsts.append(f"{vname} tensor {i} ({p.numel()} el.) {part}[{j}] kernel "
                                  f"{int(gpu[j]) & 0xFFFFFFFF:#x} torch {theirs} reference "
                                  f"{int(ref[j]) & 0xFFFFFFFF:#x}")
            i += 1
    bad = sum(c["kernel_vs_torch"] for c in cases.values())
    ms = rep.get("kernel_ms") or []
    if vs_torch:
        per = "; ".join(f"{v}: {c['kernel_vs_torch']}/{c['reference_vs_torch']}/{c['kernel_vs_reference']} of "
                        f"{c['values']}" for v, c in cases.items())
        what = (f"torch AdamW({impl}) on CUDA; mismatching values (kernel vs torch / Go reference vs torch / kernel "
                f"vs reference) per option set: {per}")
    else:
        for c in cases.values():
            c["kernel_vs_torch"] = c["reference_vs_torch"] = None
            c["by_part_vs_reference"] = c.pop("by_part")
        per = "; ".join(f"{v}: {c['kernel_vs_reference']} of {c['values']}" for v, c in cases.items())
        what = (f"not this torch's ({torch.__version__}) AdamW: kernel vs Go reference only; mismatching values per "
                f"option set: {per}")
    detail = (f"{len(params)} tensors of {min(KERNEL_SIZES)}..{KERNEL_BIG} elements, {steps} steps, {what}; kernel "
              f"{', '.join(f'{m:.3f}' for m in ms)} ms per step" + (f"; first: {' | '.join(firsts)}" if firsts else ""))
    record(name, "PASS" if bad == 0 else "FAIL", detail, impl=impl, dtype=dtname(dtype), steps=steps,
           vs_torch=vs_torch, cases=cases, loads=loads)


# --------------------------------------------------------------------------------- models
SMALL: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    tie_word_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=2)
# OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924): 6.9B parameters, 1.3B active.
FULL: dict[str, Any] = dict(
    vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
    tie_word_embeddings=False)
EXPERTS_IMPL: dict[str, str | None] = {}  # config name -> the transformers experts implementation that worked


def make_model(cfg: dict[str, Any], dtype: torch.dtype, seed: int, impl: str | None = None) -> PreTrainedModel:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    with torch.device(G.dev):
        # transformers' PreTrainedModel.to is @wraps(nn.Module.to): mypy binds no self, takes dtype for it
        model = OlmoeForCausalLM(OlmoeConfig(**cfg)).to(dtype)  # type: ignore[arg-type]
    if impl is not None:
        set_experts_impl(model, impl)
    return model


def experts_impl(model: torch.nn.Module) -> str:
    return str(getattr(model.config, "_experts_implementation", None) or "eager (default)")


def set_experts_impl(model: PreTrainedModel, impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl


def batch(vocab: int, bsz: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=G.dev).manual_seed(seed)
    return torch.randint(0, vocab, (bsz, seq), device=G.dev, generator=g)


def pick_experts_impl(cfg: dict[str, Any], dtype: torch.dtype, key: str) -> str | None:
    """transformers' default experts implementation (grouped_mm on recent GPUs), or eager if a
    forward/backward with the default fails here. Both sides of every comparison use the same."""
    if key in EXPERTS_IMPL:
        return EXPERTS_IMPL[key]
    model = make_model(cfg, dtype, 0)
    impl = None
    try:
        x = batch(cfg["vocab_size"], 2, 16, 1)
        model(input_ids=x, labels=x).loss.backward()
        impl = getattr(model.config, "_experts_implementation", None)
    except Exception as e:  # noqa: BLE001
        print(f"experts implementation {experts_impl(model)} failed ({err_text(e)}): using eager", flush=True)
        impl = "eager"
    del model
    EXPERTS_IMPL[key] = impl
    return impl


# ------------------------------------------------------------------------------- 2. sonard
class Shadow:
    """torch.optim.AdamW over clones of all parameters, fed the very gradients of the Sonar run.

    Expert gradients are cloned by post-accumulate-grad hooks registered *before* SonarAdamW's
    (hooks run in registration order), dense ones are read before opt.step() clips them."""

    def __init__(self, model: torch.nn.Module, experts: set[str], clip: float | None, kw: dict[str, Any]) -> None:
        self.names = [n for n, _ in model.named_parameters()]
        self.experts = experts
        self.params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
        self.dense = [self.params[n] for n in self.names if n not in experts]
        self.opt = torch.optim.AdamW([self.params[n] for n in self.names], **kw)
        self.clip = clip
        self.captured: dict[str, torch.Tensor | None] = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._capture(n))
                      for n, p in model.named_parameters() if n in experts]

    def _capture(self, n: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self.captured[n] = p.grad.detach().clone()

        return hook

    def take_dense(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            if n not in self.experts:
                self.captured[n] = None if p.grad is None else p.grad.detach().clone()

    def step(self) -> float | None:
        missing = [n for n in self.names if n not in self.captured]
        if missing:
            raise RuntimeError(f"no gradient captured for {missing[:3]}: SonarAdamW took it before this check's hook")
        for n in self.names:
            self.params[n].grad = self.captured[n]
        norm = None
        if self.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.dense, self.clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.captured.clear()
        return norm

    def diff(self, model: torch.nn.Module) -> dict[str, int]:
        return {n: mismatches(p, self.params[n]) for n, p in model.named_parameters()}

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def state_diff(got: dict[str, Any], want: dict[str, Any]) -> tuple[int, str]:
    """Values of want's per-parameter state (torch's) that got (SonarAdamW's state_dict) lacks or
    has different; the first difference in words."""
    bad, first = 0, ""
    gs, ws = got.get("state", {}), want.get("state", {})
    for idx, wst in ws.items():
        gst = gs.get(idx)
        for key, wv in wst.items():
            gv = None if gst is None else gst.get(key)
            if isinstance(wv, torch.Tensor):
                if not isinstance(gv, torch.Tensor):
                    n = wv.numel()
                else:
                    n = mismatches(gv.detach(), wv.detach()) if wv.dim() else int(float(gv) != float(wv))
            else:
                n = int(gv != wv)
            if n and not first:
                first = f"state[{idx}][{key!r}]: " + ("missing" if gv is None else f"{n} values differ")
            bad += n
    return bad, first


def client_per_step(before: dict[str, Any], after: dict[str, Any], steps: int) -> dict[str, Any]:
    """What SonarAdamW's client spent per timed step (between two stats(server=False)): handing
    gradients over in the hooks, waiting for updates, requests; and the latest step requests'
    median round trip, cut where the hand-overs are (us)."""
    if not before or steps <= 0:
        return {}
    per = {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in ("hand_over_s", "wait_s", "requests")}
    return {"hand_over_ms_per_step": 1e3 * per["hand_over_s"], "wait_ms_per_step": 1e3 * per["wait_s"],
            "requests_per_step": per["requests"],
            "request_us_p50": {k: round(v, 1) for k, v in (after.get("step_us_p50") or {}).items()}}


def server_stats(opt: Any) -> dict[str, Any]:
    """sonard's counters through the public stats() (best effort)."""
    try:
        st = opt.stats()
    except Exception as e:  # noqa: BLE001
        return {"error": err_text(e)}
    srv = st.get("server", {}) if isinstance(st, dict) else {}
    keep = ("device_state_bytes", "device_segments", "ipc_open", "ipc_open_bytes", "ipc_opens", "state_bytes",
            "tensors", "step_us_p50", "step_us_p99")
    out = {k: srv[k] for k in keep if k in srv}
    for k in ("expert_tensors", "dense_tensors", "peak_expert_grad_bytes", "latency_ms_p50", "latency_ms_p99"):
        if isinstance(st, dict) and k in st:
            out[k] = round(st[k], 3) if isinstance(st[k], float) else st[k]
    return out


@contextlib.contextmanager
def cuda_loads(loads: str) -> Iterator[None]:
    """SONAR_CUDA_LOADS for the duration (read as --cuda-loads by each private sonard SonarAdamW
    starts meanwhile), restored after; bench/common.py's environ() is the same for the benchmarks,
    which this script, run alone on the GPU machine, does not import."""
    saved = os.environ.get("SONAR_CUDA_LOADS")
    os.environ["SONAR_CUDA_LOADS"] = loads
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SONAR_CUDA_LOADS", None)
        else:
            os.environ["SONAR_CUDA_LOADS"] = saved


def check_sonard(ctx: argparse.Namespace) -> None:
    try:
        import sonar_moe
    except Exception as e:  # noqa: BLE001
        record("sonard", "ERROR", f"sonar_moe cannot be imported ({err_text(e)}): the wheel from scripts/gpu-check prepare")
        return
    # (dtype, max_grad_norm, fused, sonard's kernel loads): torch's CUDA default (foreach) and
    # fused=True; two of them again with the kernels' vector loads (opt-in until checked here).
    variants = [(torch.float32, None, False, "scalar"), (torch.float32, 0.5, False, "scalar"),
                (torch.bfloat16, None, False, "scalar"), (torch.bfloat16, 0.5, False, "scalar"),
                (torch.float32, None, True, "scalar"), (torch.bfloat16, 0.5, True, "scalar"),
                (torch.bfloat16, 0.5, False, "vector"), (torch.float32, None, True, "vector")]

    def vname(dtype: torch.dtype, clip: float | None, fused: bool, loads: str) -> str:
        return (f"sonard {dtname(dtype)} {'clip' if clip else 'no clip'}{' fused' if fused else ''}"
                + (" vector loads" if loads == "vector" else ""))

    if G.ipc.get("usable") is False:
        for v in variants:
            ipc_unavailable(vname(*v))
        # One attempt, for the record: what the real client and server say here (in a thread:
        # an IPC call that hangs must not take the rest of the run with it).
        said: list[str] = []

        def attempt() -> None:
            try:
                model = make_model(SMALL, torch.float32, 0)
                with sonar_moe.SonarAdamW(model):
                    pass
                said.append("SonarAdamW registered CUDA experts although the probe failed")
            except Exception as e:  # noqa: BLE001
                said.append(f"SonarAdamW on CUDA says: {err_text(e)}")

        th = threading.Thread(target=attempt, daemon=True)
        th.start()
        th.join(timeout=max(5.0, min(60.0, left())))
        record("sonard attempt without IPC", "INFO", said[0] if said else "SonarAdamW did not return within the time given")
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for dtype, clip, fused, loads in variants:
            name = vname(dtype, clip, fused, loads)
            if left() < 10:
                record(name, "SKIPPED", "out of this check's time")
                continue
            try:
                with cuda_loads(loads):
                    _sonard_variant(sonar_moe, dtype, clip, ctx.sonard_steps, name, fused)
            except Exception as e:  # noqa: BLE001
                record(name, "ERROR", err_where(e))
            gc.collect()
    finally:
        torch.use_deterministic_algorithms(False)


def _reference_run(dtype: torch.dtype, clip: float | None, steps: int, kw: dict[str, Any], impl: str | None,
                   is_expert: Callable[[str, torch.Tensor], bool]) -> dict[str, torch.Tensor]:
    model = make_model(SMALL, dtype, 0, impl)
    dense = [p for n, p in model.named_parameters() if not is_expert(n, p)]
    opt = torch.optim.AdamW(model.parameters(), **kw)
    for s in range(steps):
        x = batch(SMALL["vocab_size"], 4, 32, 100 + s)
        model(input_ids=x, labels=x).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(dense, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sonard_variant(sonar_moe: Any, dtype: torch.dtype, clip: float | None, steps: int, name: str,
                    fused: bool = False) -> None:
    kw: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    if fused:  # SonarAdamW and every torch.optim.AdamW of the comparison take the same flag
        kw["fused"] = True
    impl = pick_experts_impl(SMALL, dtype, f"small-{dtname(dtype)}")
    is_expert = sonar_moe.is_expert_param
    # (b) two independent torch runs: they must agree for the end-to-end comparison to mean anything.
    refs = [_reference_run(dtype, clip, steps, kw, impl, is_expert) for _ in range(2)]
    deterministic = all(mismatches(refs[0][n], refs[1][n]) == 0 for n in refs[0])

    model = make_model(SMALL, dtype, 0, impl)
    params = dict(model.named_parameters())
    experts = {n for n, p in params.items() if is_expert(n, p)}
    shadow = Shadow(model, experts, clip, kw)
    problems: list[str] = []
    per_step: list[dict[str, Any]] = []
    stats_first: dict[str, Any] = {}
    opt = sonar_moe.SonarAdamW(model, max_grad_norm=clip, **kw)
    try:
        for s in range(steps):
            x = batch(SMALL["vocab_size"], 4, 32, 100 + s)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            grads_left = sorted(n for n in experts if params[n].grad is not None)
            shadow.take_dense(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            norm = shadow.step()
            d = shadow.diff(model)
            per_step.append({"step": s + 1, "loss": float(loss.detach()), "dense_grad_norm": norm,
                             "expert_grads_left_after_backward": len(grads_left),
                             "values_differ": sum(d.values()), "tensors_differ": [n for n, v in d.items() if v][:8],
                             "torch_reserved": torch.cuda.memory_reserved() if G.dev == "cuda" else 0})
            if s == 0:
                stats_first = server_stats(opt)
        # (c) sonard's export through state_dict() vs torch's state of the shadow.
        sbad, sfirst = state_diff(opt.state_dict(), shadow.opt.state_dict())
        stats_last = server_stats(opt)
    finally:
        opt.close()
        shadow.close()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    del opt, model
    gc.collect()

    # (d) sonard's import: torch's state loaded into a fresh SonarAdamW, then one more step.
    ibad, ifirst, ierr = 0, "", ""
    try:
        model2 = make_model(SMALL, dtype, 1, impl)
        with torch.no_grad():
            for n, p in model2.named_parameters():
                p.copy_(shadow.params[n])
        shadow2 = Shadow(model2, experts, clip, kw)
        # Deep copies, as a checkpoint would be: torch's load_state_dict keeps the "step" tensors
        # of the dict it is given, so two optimizers loaded from one live dict would share them.
        shadow2.opt.load_state_dict(copy.deepcopy(shadow.opt.state_dict()))
        opt2 = sonar_moe.SonarAdamW(model2, max_grad_norm=clip, **kw)
        try:
            opt2.load_state_dict(copy.deepcopy(shadow.opt.state_dict()))
            x = batch(SMALL["vocab_size"], 4, 32, 100 + steps)
            model2(input_ids=x, labels=x).loss.backward()
            shadow2.take_dense(model2)
            opt2.step()
            opt2.zero_grad(set_to_none=True)
            shadow2.step()
            d2 = shadow2.diff(model2)
            ibad = sum(d2.values())
            if ibad:
                ifirst = "parameters differ: " + ", ".join(n for n, v in d2.items() if v)[:200]
            b2, f2 = state_diff(opt2.state_dict(), shadow2.opt.state_dict())
            ibad += b2
            ifirst = ifirst or f2
        finally:
            opt2.close()
            shadow2.close()
        del opt2, model2
    except Exception as e:  # noqa: BLE001
        ierr = err_text(e)

    step_bad = [p for p in per_step if p["values_differ"]]
    if step_bad:
        first_bad = step_bad[0]
        problems.append(f"after step {first_bad['step']} {first_bad['values_differ']} values differ from torch fed "
                        f"the same gradients ({', '.join(first_bad['tensors_differ'])[:200]})")
    if any(p["expert_grads_left_after_backward"] for p in per_step):
        problems.append("expert .grad not None after backward")
    if sbad:
        problems.append(f"state_dict vs torch's state: {sbad} values differ ({sfirst})")
    if ierr:
        problems.append(f"load_state_dict + step: {ierr}")
    elif ibad:
        problems.append(f"load_state_dict + step: {ibad} values differ ({ifirst})")
    ind = sum(mismatches(final[n], refs[0][n]) for n in final)
    if deterministic and ind:
        problems.append(f"{ind} values differ from an independent torch run")
    nvals = sum(t.numel() for t in final.values())
    norms = [p["dense_grad_norm"] for p in per_step if p["dense_grad_norm"] is not None]
    detail = (f"{steps} steps, {len(experts)} expert tensors ({sum(final[n].numel() for n in experts)} values) updated "
              f"by sonard during backward, {len(final) - len(experts)} dense; experts impl {impl or 'default'}. "
              f"Vs torch.optim.AdamW fed the same gradients: {sum(p['values_differ'] for p in per_step[-1:])} of "
              f"{nvals} parameter values differ after the last step; state_dict {sbad} differ; "
              + (f"load_state_dict + 1 step {ibad} differ; " if not ierr else f"load_state_dict: {ierr}; ")
              + ("independent torch run: " + (f"{ind} differ" if deterministic else
                                               "not compared (two torch runs differ: non-deterministic backward)"))
              + (f"; dense grad norms {', '.join(f'{v:.3g}' for v in norms)} (clip at {clip})" if clip else "")
              + (f"; sonard stats: {stats_last}" if stats_last else ""))
    if problems:
        detail = "; ".join(problems) + ". " + detail
    record(name, "FAIL" if problems else "PASS", detail, per_step=per_step, stats_after_step1=stats_first,
           stats_last=stats_last, independent_deterministic=deterministic)


# ----------------------------------------------------------------------------- 3. full size
def dev_used() -> int:
    if G.dev != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def sonard_pids() -> list[int]:
    """The sonard processes this process started (its children named sonard)."""
    me, pids = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        if comm == "sonard" and len(fields) > 1 and int(fields[1]) == me:
            pids.append(int(d.name))
    return pids


def gpu_process_memory() -> dict[int, int]:
    """pid -> used GPU memory, from NVML (nvidia-ml-py) or nvidia-smi; empty where neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        res = {}
        for line in out.stdout.splitlines():
            pid, mib = (v.strip() for v in line.split(","))
            res[int(pid)] = int(float(mib)) << 20
        return res
    except Exception:  # noqa: BLE001
        return {}


def check_full(ctx: argparse.Namespace) -> None:
    name = "full"
    cfg = dict(SMALL if G.selftest else FULL)
    if ctx.full_layers:
        cfg["num_hidden_layers"] = ctx.full_layers
    bsz, seq = (2, 32) if G.selftest else (ctx.full_batch, ctx.full_seq)
    notes: list[str] = []
    # The third: sonard's kernels with vector loads (--cuda-loads vector, opt-in until checked here).
    modes = ["standard+clip", "sonar+clip", "sonar+clip vector loads"]
    if G.ipc.get("usable") is False:
        ipc_unavailable("full sonar+clip")
        modes = modes[:1]
    for attempt in range(2):
        rows: list[dict[str, Any]] = []
        skipped = 0
        model = None
        try:
            model = make_model(cfg, torch.bfloat16, 0)
            sync()
            if G.dev == "cuda":
                torch.cuda.empty_cache()
            nparams = sum(p.numel() for p in model.parameters())
            import sonar_moe

            nexp = sum(p.numel() for n, p in model.named_parameters() if sonar_moe.is_expert_param(n, p))
            for mode in modes:
                if left() < 30:
                    record(f"{name} {mode}", "SKIPPED", "out of this check's time")
                    skipped += 1
                    continue
                rows.append(_full_mode(model, mode, cfg, bsz, seq, ctx, notes))
            break
        except torch.cuda.OutOfMemoryError as e:
            layers = cfg["num_hidden_layers"]
            del model
            gc.collect()
            torch.cuda.empty_cache()
            if attempt == 0 and layers > 4 and left() > 120:
                notes.append(f"out of memory with {layers} layers ({err_text(e)[:160]}): reduced to {layers // 2} layers")
                cfg["num_hidden_layers"] = layers // 2
                continue
            record(name, "ERROR", f"out of memory with {layers} layers: {err_text(e)}")
            return
        except Exception as e:  # noqa: BLE001
            record(name, "ERROR", err_where(e), rows=rows)
            return
        finally:
            model = None
            gc.collect()
            if G.dev == "cuda":
                torch.cuda.empty_cache()
    if cfg["num_hidden_layers"] != FULL["num_hidden_layers"] and not G.selftest:
        notes.append(f"{cfg['num_hidden_layers']} of OLMoE-1B-7B's 16 layers")
    lines = []
    for r in rows:
        lines.append(f"{r['mode']}: median step {r['median_s'] * 1e3:.1f} ms over {r['timed']} steps, peak "
                     f"{r['peak_total'] / 2**30:.2f} GiB (torch allocator {r['peak_torch'] / 2**30:.2f} + sonard "
                     f"{r['sonard_device'] / 2**30:.2f}); device memory outside torch's allocator grew by "
                     f"{r['outside_allocator_growth'] / 2**30:.2f} GiB during the run"
                     + (f"; NVML: sonard {r['nvml_sonard'] / 2**30:.2f} GiB" if r.get("nvml_sonard") else "")
                     + (f"; per step: {r['client']['requests_per_step']:.0f} requests, "
                        f"{r['client']['hand_over_ms_per_step']:.1f} ms handing gradients over in the hooks, "
                        f"{r['client']['wait_ms_per_step']:.1f} ms waiting for updates; a request's round trip "
                        f"(p50 us): {r['client']['request_us_p50']}" if r.get("client") else "")
                     + (f"; {r['note']}" if r.get("note") else ""))
    summary: dict[str, Any] = {}
    if len(rows) >= 2 and rows[0]["mode"] == "standard+clip" and rows[0]["peak_total"] > 0:
        a, b = rows[:2]
        summary = {"memory_change_pct": 100 * (b["peak_total"] / a["peak_total"] - 1),
                   "step_time_change_pct": 100 * (b["median_s"] / a["median_s"] - 1)}
        lines.append(f"Sonar vs standard: peak memory {summary['memory_change_pct']:+.1f}% (paper -19..-22%), "
                     f"step time {summary['step_time_change_pct']:+.1f}% (paper -17..-23%)")
        for c in rows[2:]:
            summary["vector_loads"] = {"memory_change_pct": 100 * (c["peak_total"] / a["peak_total"] - 1),
                                       "step_time_change_pct": 100 * (c["median_s"] / a["median_s"] - 1),
                                       "step_time_vs_scalar_pct": 100 * (c["median_s"] / b["median_s"] - 1)}
            v = summary["vector_loads"]
            lines.append(f"Sonar with vector loads vs standard: peak memory {v['memory_change_pct']:+.1f}%, step time "
                         f"{v['step_time_change_pct']:+.1f}% ({v['step_time_vs_scalar_pct']:+.1f}% against Sonar's "
                         "default scalar loads)")
    elif len(rows) >= 2:
        lines.append("no memory figures on the CPU: no comparison")
    elif rows:
        lines.append("no Sonar run: no comparison")
    detail = (f"OLMoE-1B-7B config{' (cpu self-test: the small config)' if G.selftest else ''}, "
              f"{cfg['num_hidden_layers']} layers, {nparams / 1e9:.2f}B params ({nexp / 1e9:.2f}B in experts), bf16, "
              f"random init, batch {bsz}x{seq}, experts impl {rows[0]['experts_impl'] if rows else '?'}; "
              + "; ".join(lines) + ("; " + "; ".join(notes) if notes else ""))
    record(name, "MEASURED" if rows else "SKIPPED" if skipped else "ERROR", detail, rows=rows, summary=summary,
           config=cfg, notes=notes)


def _full_mode(model: PreTrainedModel, mode: str, cfg: dict[str, Any], bsz: int, seq: int,
               ctx: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    import sonar_moe

    gc.collect()
    sync()
    if G.dev == "cuda":
        torch.cuda.empty_cache()
    used0 = dev_used()
    res0 = torch.cuda.memory_reserved() if G.dev == "cuda" else 0
    t_setup = time.monotonic()
    if mode == "standard+clip":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    else:
        with cuda_loads("vector" if mode.endswith("vector loads") else "scalar"):
            opt = sonar_moe.SonarAdamW(model, lr=1e-5, weight_decay=0.01, max_grad_norm=1.0)
    setup_s = time.monotonic() - t_setup
    warmup, timed = (1, 2) if G.selftest else (ctx.full_warmup, ctx.full_steps)
    times: list[float] = []
    rows_note = ""
    client0: dict[str, Any] = {}
    try:
        s = 0
        while s < warmup + timed:
            if s == warmup:
                sync()
                if G.dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if mode != "standard+clip":
                    client0 = opt.stats(server=False)
            est = (times[-1] if times else 5.0) * 1.5 + 5
            if times and left() < est + (15 if len(times) >= 3 else 0):
                rows_note = f"{len(times)} of {timed} timed steps (out of time)"
                break
            if not times and left() < 0:
                raise TimeoutError(f"out of this check's time after {s} of {warmup} warm-up steps")
            x = batch(cfg["vocab_size"], bsz, seq, s)
            sync()
            t0 = time.perf_counter()
            try:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - the default experts implementation failed: eager
                if s != 0 or mode != "standard+clip" or experts_impl(model).startswith("eager"):
                    raise
                notes.append(f"experts impl {experts_impl(model)} failed ({err_text(e)[:160]}): eager")
                opt.zero_grad(set_to_none=True)
                set_experts_impl(model, "eager")
                continue
            if mode == "standard+clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if s >= warmup:
                times.append(time.perf_counter() - t0)
            s += 1
        if not times:
            raise RuntimeError("no timed step")
        peak = torch.cuda.max_memory_allocated() if G.dev == "cuda" else 0
        peak_res = torch.cuda.max_memory_reserved() if G.dev == "cuda" else 0
        used1 = dev_used()
        res1 = torch.cuda.memory_reserved() if G.dev == "cuda" else 0
        outside = (used1 - used0) - (res1 - res0)  # device memory that grew outside torch's allocator
        per_proc = gpu_process_memory() if G.dev == "cuda" else {}
        row: dict[str, Any] = {"mode": mode, "median_s": statistics.median(times), "times_s": times,
                               "timed": len(times), "setup_s": setup_s, "peak_torch": peak,
                               "peak_torch_reserved": peak_res, "outside_allocator_growth": outside,
                               "experts_impl": experts_impl(model), "note": rows_note,
                               "nvml_this_process": per_proc.get(os.getpid())}
        if mode == "standard+clip":
            row["sonard_device"] = 0
            row["peak_total"] = peak
        else:
            pids = sonard_pids()
            row["sonard_pids"] = pids
            row["nvml_sonard"] = sum(per_proc.get(p, 0) for p in pids) if any(p in per_proc for p in pids) else None
            row["sonard_stats"] = server_stats(opt)
            row["client"] = client_per_step(client0, opt.stats(server=False), len(times))
            # sonard's device memory (state, kernels, its CUDA context): what the device's used
            # memory grew by outside torch's allocator since just before SonarAdamW was built.
            row["sonard_device"] = max(0, outside)
            row["peak_total"] = peak + row["sonard_device"]
        return row
    finally:
        if hasattr(opt, "close"):
            opt.close()
        del opt
        gc.collect()
        if G.dev == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- 4. bench
def check_bench(ctx: argparse.Namespace) -> None:
    kc = ctx.kernelcheck
    layer = 64 * 2048 * 1024 * 3  # one OLMoE layer's experts: gate_up [64, 2048, 2048] + down [64, 2048, 1024]
    if not (kc and os.access(kc, os.X_OK)):
        record("bench", "ERROR", f"{kc or 'sonar-kernelcheck'} not found")
        return
    for impl, flags in (("foreach", []), ("fused", ["-fused"])):
        name = "bench kernel" if impl == "foreach" else f"bench {impl} kernel"
        if left() < 12:
            record(name, "SKIPPED", "out of this check's time")
            continue
        try:
            out = subprocess.run([kc, "bench", "-dtype", "bfloat16", "-numel", str(layer), "-tensors", "2", "-iters",
                                  "20", *flags], capture_output=True, text=True, timeout=max(10.0, min(90.0, left())))
            if out.returncode != 0:
                raise RuntimeError(out.stderr.strip()[-600:])
            r = json.loads(out.stdout)
            tms = _torch_adamw_ms(layer, impl)
            by = r.get("by_loads") or {r.get("loads", "scalar"): r}
            kern = "; ".join(f"{n} loads {v['ms_per_step']:.2f} ms ({v['gbytes_per_s']:.0f} GB/s)" for n, v in by.items())
            record(name, "MEASURED",
                   f"bf16 AdamW ({impl}) over one OLMoE layer's experts ({layer / 1e6:.0f}M values, 2 tensors, 14 bytes "
                   f"per value, medians of alternating rounds): sonard's kernel, {kern}; torch AdamW({impl}) "
                   f"{tms:.2f} ms ({layer * 14 / tms / 1e6:.0f} GB/s)", kernel=r, torch_ms=tms, impl=impl)
        except Exception as e:  # noqa: BLE001
            record(name, "ERROR", err_text(e))


def _torch_adamw_ms(layer: int, impl: str) -> float:
    """torch's AdamW (foreach, or fused=True) over the bench's tensors, in this process: ms per step."""
    per = layer // 2
    ps = [torch.nn.Parameter(torch.zeros(per, dtype=torch.bfloat16, device="cuda")) for _ in range(2)]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **KERNEL_IMPLS[impl])
    opt.step()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        opt.step()
    b.record()
    torch.cuda.synchronize()
    tms = a.elapsed_time(b) / 10
    del opt, ps
    torch.cuda.empty_cache()
    return tms


# ------------------------------------------------------------------------------------ report
def environment(ctx: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if gpu:
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs"
    else:
        env["gpu"] = "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except Exception:  # noqa: BLE001
        env["driver"] = "unknown (no nvidia-smi)"
    rel = platform.release()
    env["kernel"] = rel + (" (gVisor reports 4.4.0)" if rel.startswith("4.4.0") else "")
    env["python"] = platform.python_version()
    env["torch"] = f"{torch.__version__}, CUDA {torch.version.cuda}"
    for mod in ("transformers", "numpy", "sonar_moe", "zmq", "msgpack"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            env[mod] = f"missing ({type(e).__name__})"
    env["allocator"] = "; ".join(ALLOC_NOTES) or (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "torch defaults")
    return env


def cpu_isa() -> str:
    """The widest CPU kernel level of this host (as the optimizer package detects it)."""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not {"avx2", "fma"} <= flags:
        return "go"
    if "avx512f" not in flags:
        return "avx2"
    if not {"avx512_bf16", "avx512bw", "avx512dq"} <= flags:
        return "avx512"
    return "avx512vbmi" if "avx512vbmi" in flags else "avx512bf16"


def check_cpu_kernels(ctx: argparse.Namespace) -> None:
    """The optimizer package's kernel tests on this host's CPU, required to run its widest level."""
    test = ctx.optimizer_test
    if not (test and os.access(test, os.X_OK)):
        record("cpu-kernels", "ERROR", f"{test} not found: `scripts/gpu-check prepare` builds it")
        return
    isa = cpu_isa()
    env = {**os.environ, "SONAR_REQUIRE_ISA": isa}
    run = subprocess.run([test, "-test.run", "Assembly|ISA|StepBF16|BF16Narrowing|BF16Table", "-test.short", "-test.v",
                          "-test.count=1"], capture_output=True,
                         text=True, env=env, timeout=max(10.0, G.check_deadline - time.monotonic()))
    tail = (run.stdout + run.stderr).strip().splitlines()[-12:]
    status = "PASS" if run.returncode == 0 else "FAIL"
    record("cpu-kernels", status, f"CPU kernels at {isa} vs the Go code: exit {run.returncode}", isa=isa,
           output="\n".join(tail))


def kernelcheck_info(ctx: argparse.Namespace) -> None:
    kc = ctx.kernelcheck
    if not (kc and os.access(kc, os.X_OK)):
        G.env["kernelcheck"] = f"not found ({kc})"
        return
    try:
        info = subprocess.run([kc, "info"], capture_output=True, text=True, timeout=60)
        if info.returncode == 0:
            G.env["kernelcheck"] = json.loads(info.stdout)
        else:
            G.env["kernelcheck"] = f"info failed: {info.stderr.strip()[-300:]}"
    except Exception as e:  # noqa: BLE001
        G.env["kernelcheck"] = f"info failed: {err_text(e)}"


def write_report() -> None:
    with G.lock:
        results = list(G.results)
    path = G.out
    title = "GPU check results" + (" (CPU self-test of the check's harness: NOT GPU results)" if G.selftest else "")
    lines = [f"# {title}", "",
             f"Written by scripts/gpu_check.py (`scripts/gpu-check run`) on {G.env.get('date', '?')}. "
             "What each check does: docs/gpu.md.", "", "## Machine", ""]
    for k, v in G.env.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items() if a in ("device", "cc", "driver_cuda", "nvrtc_version", "arch"))
        lines.append(f"- {k}: {v}")
    lines += ["", "## Cross-process CUDA IPC", ""]
    ok, usable = G.ipc.get("ok"), G.ipc.get("usable")
    if ok is True:
        lines.append("Cross-process CUDA IPC **works** on this machine: " + G.ipc["summary"] + ".")
    elif usable is False:
        lines.append("Cross-process CUDA IPC **does not work** on this machine, so nothing that needs sonard (a second "
                     "process) could run here: " + G.ipc["summary"] + ". The checks that need no second process ran.")
    elif ok is False:
        lines.append("Cross-process CUDA IPC **partly works** on this machine: " + G.ipc["summary"] + ". The sonard "
                     "checks ran anyway.")
    else:
        lines.append(f"Not established ({G.ipc['summary']}).")
    lines += ["", "## Checks", "", "| check | status | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
        secs = f"{r['seconds']:.0f}" if isinstance(r.get("seconds"), (int, float)) else ""
        lines.append(f"| {r['check']} | {r['status']} | {secs} | {detail} |")
    full = [r for r in results if r["check"] == "full" and r.get("rows")]
    if full:
        lines += ["", "## Full size: standard AdamW + global clipping vs Sonar", "",
                  "| run | median step (ms) | torch peak allocated (GiB) | sonard device memory (GiB) | peak total (GiB) "
                  "| torch peak reserved (GiB) |", "|---|---|---|---|---|---|"]
        for row in full[-1]["rows"]:
            lines.append(f"| {row['mode']} | {row['median_s'] * 1e3:.1f} | {row['peak_torch'] / 2**30:.2f} | "
                         f"{row['sonard_device'] / 2**30:.2f} | {row['peak_total'] / 2**30:.2f} | "
                         f"{row['peak_torch_reserved'] / 2**30:.2f} |")
        sm = full[-1].get("summary") or {}
        if sm:
            lines += ["", f"Sonar vs standard: peak memory {sm['memory_change_pct']:+.1f}% (paper: -19 to -22%), "
                      f"median step time {sm['step_time_change_pct']:+.1f}% (paper: -17 to -23%)."]
        lines += ["", "sonard's device memory is the growth of the device's used memory (cuMemGetInfo) outside torch's "
                  "allocator between just before SonarAdamW was built and the end of the timed steps: its optimizer "
                  "state, kernels and CUDA context. NVML's per-process figure, where it answers, is in "
                  "gpu-results.json (`nvml_sonard`). The trainer's own CUDA context is in neither side's figure."]
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    jpath = path.with_suffix(".json")
    jpath.write_text(json.dumps({"env": G.env, "ipc": G.ipc, "results": results}, indent=1, default=str))
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        for src, dst in ((path, "gpu-results.md"), (jpath, "gpu-results.json")):
            try:
                shutil.copyfile(src, os.path.join(out, dst))
            except OSError:
                pass


def abort(why: str, code: int) -> None:
    """Record why the run stops, write the report, exit at once (the watchdog and SIGTERM)."""
    record(G.current or "run", "TIMEOUT" if code == 124 else "ABORTED", why)
    try:
        write_report()
    finally:
        os._exit(code)


def start_watchdog(limit_s: float) -> None:
    def watch() -> None:
        while time.monotonic() < G.start + limit_s:
            time.sleep(1)
        abort(f"still running {limit_s:.0f} s after the start: stopped by the check's watchdog", 124)

    threading.Thread(target=watch, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: abort("terminated (SIGTERM, e.g. the wrapper's timeout)", 124))


CHECKS = ["ipc", "sonard-start", "kernel", "sonard", "full", "bench", "cpu-kernels"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="checks: " + ", ".join(CHECKS) + ". See docs/gpu.md.")
    ap.add_argument("--kernelcheck", default="build/gpu/sonar-kernelcheck", help="the sonar-kernelcheck binary")
    ap.add_argument("--optimizer-test", default="build/gpu/optimizer.test",
                    help="the optimizer package's test binary (CPU kernels)")
    ap.add_argument("--out", default="docs/gpu-results.md", help="report (Markdown); the JSON goes next to it")
    ap.add_argument("--budget", type=float, default=440, help="seconds for all checks (default 440)")
    ap.add_argument("--grace", type=float, default=20, help="the watchdog stops the run this long after the budget")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(CHECKS))
    ap.add_argument("--sonard-steps", type=int, default=4, help="training steps of the small OLMoE per variant")
    ap.add_argument("--full-batch", type=int, default=4)
    ap.add_argument("--full-seq", type=int, default=1024)
    ap.add_argument("--full-layers", type=int, default=0, help="layers of the full-size model (0: OLMoE's 16)")
    ap.add_argument("--full-warmup", type=int, default=3)
    ap.add_argument("--full-steps", type=int, default=10, help="timed steps per full-size run")
    ap.add_argument("--no-gpu", action="store_true", help="behave as on a machine without a GPU")
    ap.add_argument("--cpu-selftest", action="store_true",
                    help="run the sonard and full checks' harness on the CPU (tiny config): tests this script only")
    args = ap.parse_args()
    G.start = time.monotonic()
    G.deadline = G.start + args.budget
    G.out = Path(args.out)
    G.selftest = args.cpu_selftest
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}: choose from {CHECKS}")
    selected = [c for c in CHECKS if not only or c in only]
    gpu = torch.cuda.is_available() and not args.no_gpu and not args.cpu_selftest
    G.dev = "cuda" if gpu else "cpu"
    G.env = environment(args, gpu)
    start_watchdog(args.budget + args.grace)

    if args.cpu_selftest:
        G.ipc.update(ok=None, summary="not probed: CPU self-test")
        G.check_deadline = G.deadline
        fn: Callable[[argparse.Namespace], None]
        for key, fn in (("sonard", check_sonard), ("full", check_full)):
            if key in selected:
                G.current = key
                t0, n0 = time.monotonic(), len(G.results)
                try:
                    fn(args)
                except Exception as e:  # noqa: BLE001
                    record(key, "ERROR", err_where(e))
                if len(G.results) > n0:
                    G.results[n0].setdefault("seconds", time.monotonic() - t0)
                write_report()
        write_report()
        return 1 if any(r["status"] in ("FAIL", "ERROR", "TIMEOUT") for r in G.results) else 0

    if not gpu:
        kernelcheck_info(args)
        reason = "--no-gpu" if args.no_gpu else "torch.cuda.is_available() is False on this machine"
        G.ipc.update(ok=None, summary="not probed: no GPU")
        record("gpu", "NO-GPU", f"no CUDA GPU ({reason}): nothing was checked")
        for key in selected:
            record(key, "NOT-RUN", "no GPU")
        write_report()
        print(f"no GPU: wrote {G.out}", flush=True)
        return 0

    kernelcheck_info(args)
    print(json.dumps(G.env, indent=1, default=str), flush=True)
    # key, function, at most (s), at least (s) to be worth starting
    plan: list[tuple[str, Callable[[argparse.Namespace], None], float, float]] = [
        ("ipc", check_ipc, 90, 20), ("sonard-start", check_sonard_start, 45, 5), ("kernel", check_kernel, 120, 15),
        ("sonard", check_sonard, 150, 20), ("full", check_full, 240, 90), ("bench", check_bench, 40, 10),
        ("cpu-kernels", check_cpu_kernels, 60, 10)]
    if any(k in selected for k in ("sonard", "full")) and "ipc" not in selected:
        selected.insert(0, "ipc")  # the others depend on it
    plan = [p for p in plan if p[0] in selected]
    for i, (key, fn, cap, need) in enumerate(plan):
        reserve = sum(p[3] for p in plan[i + 1:])
        now = time.monotonic()
        G.check_deadline = min(now + cap, G.deadline - reserve)
        if G.check_deadline - now < need:
            record(key, "SKIPPED", f"{G.deadline - now:.0f} s left of the run's budget, {reserve:.0f} s kept for the "
                   f"checks after it; needs ~{need:.0f} s")
            continue
        G.current = key
        t0 = time.monotonic()
        n0 = len(G.results)
        try:
            fn(args)
        except Exception as e:  # noqa: BLE001 - one check's failure must not stop the others
            record(key, "ERROR", err_where(e))
        took = time.monotonic() - t0
        if len(G.results) > n0:
            G.results[n0].setdefault("seconds", took)
        print(f"-- {key} took {took:.1f} s ({G.deadline - time.monotonic():.0f} s of the budget left)", flush=True)
        write_report()  # after each check: a timeout still leaves the results so far
        G.current = ""
    write_report()
    return 1 if any(r["status"] in ("FAIL", "ERROR", "TIMEOUT") for r in G.results) else 0


if __name__ == "__main__":
    sys.exit(main())
