"""Faults are errors, never crashes (issue 16, items 1, 2 and 8), against a real sonard and
real shared memory: a segment truncated after attach, /dev/shm without room (in a private
mount namespace with a small tmpfs), a state budget, an address-space limit, a crash's cause
in one line, integer fields out of range."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import sonar_moe
from sonar_moe import Connection, SonarRefused, SonarServerDied, start_private_server, torch_scalars
from sonar_moe._connection import death_cause
from sonar_moe._shm import SHM_DIR, Segment
from lifetime_util import stop

ROOT = Path(__file__).resolve().parents[1]
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}
N = 4096  # float32 elements of each test tensor


class Client:
    """A session of its own on a server: a parameter segment, a gradient segment kept open
    (so that the test can truncate it after the server unlinked its name), a transfer
    segment, and one registered tensor stepped once."""

    def __init__(self, addr: str, *, conn: Connection | None = None) -> None:
        self.conn = conn or Connection(addr, timeout=10.0)
        self.conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": torch.__version__, "threads": 1,
                                 "capability": ""})
        self.params, self.grads, self.xfer = Segment(4 * N, "p"), Segment(4 * N, "g"), Segment(8 * N + 4096, "x")
        self.grad_fd = os.open(self.grads.path, os.O_RDWR)
        g = torch.Generator().manual_seed(len(addr))
        self.params.tensor(0, torch.float32, (N,)).copy_(torch.randn(N, generator=g))
        self.grads.tensor(0, torch.float32, (N,)).copy_(torch.randn(N, generator=g))
        self.segs = {}
        for name, seg in (("p", self.params), ("g", self.grads), ("x", self.xfer)):
            self.segs[name] = self.conn.call("attach", {"shm": seg.name, "size": seg.size})["seg"]
        self.tid = self.conn.call("register", {"tensors": [{
            "name": "w", "shape": [N], "dtype": "float32", "hyper": HYPER,
            "param": {"seg": self.segs["p"], "off": 0, "nbytes": 4 * N}}]})["ids"][0]
        self.steps = 0
        self.step()

    def step(self) -> dict[str, Any]:
        self.steps += 1
        return self.conn.call("step", {"items": [{
            "tensor": self.tid, "grad": {"seg": self.segs["g"], "off": 0, "nbytes": 4 * N}, "apply": True,
            "step": self.steps, "scalars": torch_scalars(GROUP, float(self.steps))}]})

    def state(self) -> tuple[bytes, bytes, bytes, int]:
        rep = self.conn.call("export", {"tensor": self.tid, "step": 0,
                                        "exp_avg": {"seg": self.segs["x"], "off": 0, "nbytes": 4 * N},
                                        "exp_avg_sq": {"seg": self.segs["x"], "off": 4 * N + 4096, "nbytes": 4 * N},
                                        "max_exp_avg_sq": {"seg": 0, "off": 0, "nbytes": 0}})
        return (bytes(self.params.mm[: 4 * N]), bytes(self.xfer.mm[: 4 * N]),
                bytes(self.xfer.mm[4 * N + 4096: 8 * N + 4096]), rep["step"])

    def close(self) -> None:
        os.close(self.grad_fd)


def test_truncated_segment_gives_an_error_reply_and_the_server_lives() -> None:
    """Issue 16 (a): a client truncates its gradient segment after attach and steps. Before,
    sonard died of SIGBUS; now the step is refused with an error naming the segment, nothing
    of the tensor changes, the server keeps serving, and another session's state is intact."""
    conn = start_private_server(timeout=10.0)
    a = Client(conn.address, conn=conn)
    b = Client(conn.address)
    try:
        b_before = b.state()
        a_before = a.state()
        os.ftruncate(a.grad_fd, 0)  # the attack: the server's mapping of it now faults
        with pytest.raises(SonarRefused, match=r"sonar-.*-g.*truncated to 0 bytes"):
            a.step()
        a.steps -= 1
        assert conn.server_alive
        assert a.state() == a_before  # the refused step changed nothing
        assert b.state() == b_before
        b.step()  # the server keeps serving the other session
        assert b.state()[3] == 2
        stats = conn.call("stats", {})
        assert stats["sessions"] == 2 and stats["tensors"] == 2
    finally:
        a.close()
        b.close()
        b.conn.close()
        conn.shutdown()
    assert conn.process is not None and conn.process.returncode == 0


def test_truncate_during_a_step_is_caught_and_the_tensor_marked_damaged() -> None:
    """Issue 16 (a), the race the size check cannot close: the client truncates its gradient
    segment while the server is inside the step (a 128 MiB tensor; the truncate comes a third
    of a step's time after the request). The SIGBUS in the engine's workers becomes an error
    reply saying the parameter and state may be partly updated; the tensor then refuses steps
    and exports until an import replaces its state; another session is untouched."""
    n = 32 << 20
    conn = start_private_server(timeout=60.0)
    other = Client(conn.address)
    try:
        other_before = other.state()
        conn.call("hello", {"client": "t", "pid": os.getpid(), "torch": "", "threads": 1, "capability": ""})
        params, xfer = Segment(4 * n, "p"), Segment(8 * n + 4096, "x")
        ps = conn.call("attach", {"shm": params.name, "size": params.size})["seg"]
        xs = conn.call("attach", {"shm": xfer.name, "size": xfer.size})["seg"]
        item: dict[str, Any] = {"grad": {"off": 0, "nbytes": 4 * n}, "apply": True, "step": 1,
                                "scalars": torch_scalars(GROUP, 1.0)}
        hit = None
        for attempt in range(4):
            tid = conn.call("register", {"tensors": [{"name": f"w{attempt}", "shape": [n], "dtype": "float32",
                                                      "hyper": HYPER, "param": {"seg": ps, "off": 0, "nbytes": 4 * n}}]})["ids"][0]
            grads = Segment(4 * n, "g")
            fd = os.open(grads.path, os.O_RDWR)
            gs = conn.call("attach", {"shm": grads.name, "size": grads.size})["seg"]
            body = {"items": [{**item, "tensor": tid, "grad": {**item["grad"], "seg": gs}}]}
            conn.call("step", body)  # the first step also faults the state's pages in
            body["items"][0].update(step=2, scalars=torch_scalars(GROUP, 2.0))
            start = time.monotonic()
            conn.call("step", body)  # a full step, to time it
            took = time.monotonic() - start
            body["items"][0].update(step=3, scalars=torch_scalars(GROUP, 3.0))
            timer = threading.Timer(took / 3, os.ftruncate, (fd, 0))
            timer.start()
            try:
                conn.call("step", body)
                outcome = "ok"
            except SonarRefused as e:
                outcome = str(e)
            timer.join()
            os.close(fd)
            assert conn.server_alive, outcome
            if "memory fault" in outcome:
                hit = (tid, outcome)
                break
            # Truncated before the request was checked ("truncated") or after it ran ("ok"): again.
            assert outcome == "ok" or "truncated" in outcome, outcome
        if hit is None:
            pytest.skip("the truncate never landed inside a step")
        tid, outcome = hit
        assert "partly updated" in outcome and "may be" in outcome, outcome
        xref = {"exp_avg": {"seg": xs, "off": 0, "nbytes": 4 * n},
                "exp_avg_sq": {"seg": xs, "off": 4 * n + 4096, "nbytes": 4 * n},
                "max_exp_avg_sq": {"seg": 0, "off": 0, "nbytes": 0}}
        with pytest.raises(SonarRefused, match="damaged"):
            conn.call("export", {"tensor": tid, "step": 0, **xref})
        conn.call("import", {"tensor": tid, "step": 2, **xref})  # replaces the state: usable again
        conn.call("export", {"tensor": tid, "step": 0, **xref})
        assert other.state() == other_before
        other.step()
    finally:
        other.close()
        other.conn.close()
        conn.shutdown()


def test_sparse_terabyte_segment_is_refused_at_attach() -> None:
    """Issue 16 (b): a 2^38-element tensor over a sparse 1 TiB segment. The segment is refused
    at attach (its pages are not reserved), before anything is mapped or allocated."""
    conn = start_private_server(timeout=10.0)
    name = f"sonar-{os.getpid()}-sparse-tib"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 40)  # sparse: no page allocated
        with pytest.raises(SonarRefused, match="posix_fallocate"):
            conn.call("attach", {"shm": name, "size": 1 << 40})
        assert conn.server_alive and conn.call("stats", {})["segments"] == 0
    finally:
        os.close(fd)
        os.unlink(path)
        conn.shutdown()


def test_state_budget_refuses_register_and_changes_nothing(sonard_binary: str, tmp_path: Path) -> None:
    """Issue 16 (b): --max-state-bytes. A register beyond it is refused with an error that says
    how much it needs and how much the budget holds; nothing is registered; the server serves on."""
    addr = f"ipc://{tmp_path}/run/sonard.sock"
    proc = subprocess.Popen([sonard_binary, "--listen", addr, "--log-level", "warn", "--max-state-bytes", "48KiB"])
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{tmp_path}/run/sonard.sock") and time.monotonic() < deadline:
            time.sleep(0.02)
        a = Client(addr)  # 32 KiB of state: fits
        with pytest.raises(SonarRefused, match=r"over the memory budget.*32\.0 KiB.*32\.0 KiB of its 48\.0 KiB.*nothing was registered"):
            Client(addr)  # another 32 KiB: over the total
        stats = a.conn.call("stats", {})
        assert stats["tensors"] == 1 and stats["state_bytes"] == 32 << 10
        a.step()
        a.close()
        a.conn.call("bye", {})
        a.conn.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_state_budget_from_environment_reaches_the_private_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """SONAR_MAX_SESSION_STATE_BYTES bounds a private sonard, which takes no flags."""
    monkeypatch.setenv("SONAR_MAX_SESSION_STATE_BYTES", "16KiB")
    conn = start_private_server(timeout=10.0)
    try:
        with pytest.raises(SonarRefused, match=r"over the memory budget.*--max-session-state-bytes"):
            Client(conn.address, conn=conn)
        assert conn.call("stats", {})["tensors"] == 0
    finally:
        conn.shutdown()


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmSize")


def test_state_allocation_failure_is_an_error_not_a_crash() -> None:
    """Issue 16 (b): a tensor within every documented limit under an address-space limit
    (ulimit -v). Before, Go's fatal "out of memory" killed sonard; now the state is mapped
    from the kernel and the refusal is an error reply."""
    conn = start_private_server(timeout=10.0)
    assert conn.process is not None
    size = 256 << 20  # parameter; its state needs twice that
    seg = Segment(size, "big")
    try:
        conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": "", "threads": 1, "capability": ""})
        limit = _vm_size(conn.process.pid) + size + (128 << 20)
        resource.prlimit(conn.process.pid, resource.RLIMIT_AS, (limit, limit))
        sid = conn.call("attach", {"shm": seg.name, "size": size})["seg"]
        with pytest.raises(SonarRefused, match="optimizer state: allocate .*cannot allocate memory"):
            conn.call("register", {"tensors": [{"name": "big", "shape": [size // 4], "dtype": "float32", "hyper": HYPER,
                                                "param": {"seg": sid, "off": 0, "nbytes": size}}]})
        assert conn.server_alive
        assert conn.call("stats", {})["tensors"] == 0
    finally:
        seg.mm.close()
        conn.shutdown()


def test_crash_is_named_in_one_line() -> None:
    """A private sonard that crashes (SIGQUIT makes the Go runtime dump every goroutine and
    exit with status 2, as a fatal error does): the client's error is one line naming it."""
    conn = start_private_server(timeout=5.0)
    assert conn.process is not None
    conn.call("hello", {"client": "test", "pid": os.getpid(), "torch": "", "threads": 1, "capability": ""})
    os.kill(conn.process.pid, signal.SIGQUIT)
    conn.process.wait(timeout=10)
    with pytest.raises(SonarServerDied) as exc:
        conn.call("stats", {})
    msg = str(exc.value)
    assert "\n" not in msg and "goroutine" not in msg, msg
    assert msg.startswith("sonard exited: crashed (status 2") and "SIGQUIT: quit" in msg, msg
    assert "goroutine" in exc.value.log_tail
    conn.shutdown()


@pytest.mark.parametrize("code, log, want", [
    (2, "unexpected fault address 0x7f3a2c000000\nfatal error: fault\n[signal SIGBUS: bus error code=0x2 "
        "addr=0x7f3a2c000000 pc=0x4a1b2c]\n\ngoroutine 1 gp=0xc000002380 m=0 [running]:\n" + "x\n" * 5000,
     "crashed (status 2, a Go runtime error, a bug of sonard): unexpected fault address 0x7f3a2c000000; "
     "fatal error: fault; [signal SIGBUS: bus error code=0x2 addr=0x7f3a2c000000 pc=0x4a1b2c]"),
    (2, "fatal error: runtime: out of memory\n\ngoroutine 7 [running]:\n", "out of memory"),
    (-9, "", "killed by SIGKILL (the kernel's OOM killer"),
    (1, '2026-12-01T01:00:00Z\tERROR\tlisten failed\t{"error": "bind: address in use"}\n', "runtime failure (status 1): 2026-12-01T01:00:00Z\tERROR\tlisten failed"),
    (64, "sonard: --max-state-bytes \"x\": want a byte count\n", "bad flags (status 64): sonard: --max-state-bytes"),
])
def test_death_cause(code: int, log: str, want: str) -> None:
    cause = death_cause(code, log)
    assert cause.startswith("sonard exited: ") and "\n" not in cause and want in cause, cause


@pytest.mark.parametrize("body, field", [
    ({"tensor": 2**32 + 1, "grad": {"seg": 1, "off": 0, "nbytes": 4}, "apply": False}, r"items\[0\]\.tensor"),
    ({"tensor": 1, "grad": {"seg": 2**32, "off": 0, "nbytes": 4}, "apply": False}, r"items\[0\]\.grad\.seg"),
    ({"tensor": 1, "grad": {"seg": 1, "off": 2**63, "nbytes": 4}, "apply": False}, r"items\[0\]\.grad\.off"),
    ({"tensor": -1, "grad": {"seg": 1, "off": 0, "nbytes": 4}, "apply": False}, r"items\[0\]\.tensor"),
])
def test_integer_fields_out_of_range_are_refused(body: dict[str, Any], field: str) -> None:
    """Issue 16 (c): a u32 field of 2^32+n used to wrap to n (and name another tensor or
    segment); out-of-range integers are now refused, naming the field."""
    conn = start_private_server(timeout=10.0)
    try:
        with pytest.raises(SonarRefused, match=f"out of range.*{field}|{field}.*out of range"):
            conn.call("step", {"items": [body]})
        assert conn.server_alive
    finally:
        conn.shutdown()


# ------------------------------------------------------------------ /dev/shm without room

SHM_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import sonar_moe, tiny_moe as tm
    from sonar_moe._shm import shm_free

    def fill(f, leave):
        os.ftruncate(f.fileno(), 0)
        os.posix_fallocate(f.fileno(), 0, shm_free() - leave)

    filler = open("/dev/shm/filler", "wb")
    model = tm.build(tm.MoEConfig(), 0)
    x = torch.randint(0, 256, (2, 16))
    # 1. Too little room for the parameters and the gradient ring.
    fill(filler, 4096)
    try:
        sonar_moe.SonarAdamW(model)
        print("CONSTRUCT: no error")
    except sonar_moe.ShmFullError as e:
        print("CONSTRUCT:", e)
    # 2. Room for parameters and ring, not for the state transfer of state_dict().
    os.ftruncate(filler.fileno(), 0)
    opt = sonar_moe.SonarAdamW(model)
    loss, _ = model(x, labels=x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    fill(filler, 4096)
    try:
        opt.state_dict()
        print("STATE_DICT: no error")
    except sonar_moe.ShmFullError as e:
        print("STATE_DICT:", e)
    print("ALIVE:", opt.server_process.poll() is None)
    os.ftruncate(filler.fileno(), 0)
    sd = opt.state_dict()
    loss, _ = model(x, labels=x)
    loss.backward()
    opt.step()
    print("AFTER: state of", len(sd["state"]), "params, step", int(sd["state"][0]["step"]))
    opt.close()
""")


def test_full_dev_shm_gives_clear_errors(tmp_path: Path) -> None:
    """Issue 16 (a): with /dev/shm (a 64 MiB tmpfs in a private mount namespace) holding too
    little, the trainer used to die of SIGBUS with no message, and a state_dict() whose
    transfer segment did not fit killed the server. Now each raises ShmFullError saying how much
    is missing, the server lives, and training goes on once there is room."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "shm_full.py"
    script.write_text(SHM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'pyclient'}:{ROOT / 'examples'}")
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec {sys.executable} {script}"],
                       capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert "CONSTRUCT: sonar: /dev/shm has no room for the expert parameters" in out or \
        "CONSTRUCT: sonar: /dev/shm has no room for the gradient ring" in out, out
    assert "STATE_DICT: sonar: /dev/shm has no room for the state transfer" in out, out
    assert "MiB missing" in out and "ALIVE: True" in out and "AFTER: state of" in out, out


def test_server_killed_with_updates_in_flight_says_the_experts_may_be_partly_updated() -> None:
    """sonard killed (SIGKILL, the OOM killer) while expert updates were in flight: its kernel
    may have stepped part of a tensor's elements (a red team saw 44-95%), so the error says so,
    beside the signal (it named the signal only)."""
    from moe_util import TinyMoE

    torch.manual_seed(0)
    model = TinyMoE(torch.float32)
    x = torch.randn(4, 9)
    with sonar_moe.SonarAdamW(model, lr=1e-2, ring_layers=0, timeout=10.0) as opt:
        model(x).backward()
        opt.step()
        opt.zero_grad()
        proc = opt.server_process
        assert proc is not None
        stop(proc.pid)  # every thread stopped: the next update stays in flight...
        threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL)).start()  # ...until the kill
        with pytest.raises(SonarServerDied, match=r"killed by SIGKILL.*in flight.*may be partly updated"):
            model(x).backward()
