"""Zero-copy CPU gradients: sonard reads each expert gradient where autograd left it
(process_vm_readv), the default wherever the server can read the trainer's memory.

Bitwise equality with torch.optim.AdamW is the rest of the suite's (it runs zero copy by
default); here: the ring fallback is still exact, what is held waits within the same budget,
and the server reads only the connected process, only at addresses that are mapped."""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import sonar_moe
from sonar_moe import SonarError, start_private_server, torch_scalars
from sonar_moe._launch import private_workers
from sonar_moe._shm import PAGE, Ring, Segment

from moe_util import TinyMoE, assert_same_params, train_beside

N = 1000
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("ring_layers", [0, 1])
def test_bitwise_either_way(dtype: torch.dtype, zero_copy: bool, ring_layers: int) -> None:
    """Zero copy and the ring give torch's bits, with accumulation (k=2) and several steps,
    whether each hook waits for its update (0) or a layer may wait (1)."""
    torch.manual_seed(1)
    model = TinyMoE(dtype)
    ref = copy.deepcopy(model)
    opt = sonar_moe.SonarAdamW(model, lr=3e-3, weight_decay=0.05, grad_accumulation_steps=2, zero_copy=zero_copy,
                               ring_layers=ring_layers)
    topt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05)
    try:
        st = opt.stats()
        assert st["zero_copy"] is zero_copy
        assert (st["ring_bytes"] == 0) is zero_copy  # zero copy makes no ring
        train_beside(model, ref, opt, topt, lambda: torch.randn(5, 9, dtype=dtype), steps=3, micro=2)
        assert_same_params(model, ref)
        assert opt.stats()["held_grad_bytes"] == 0  # everything given back after step()
    finally:
        opt.close()


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("ring_layers", [0, 1, 2])
def test_held_bytes_within_budget(ring_layers: int, zero_copy: bool) -> None:
    """Gradients wait for the server within ring_layers of the largest layer (0: a hook that
    sends a request waits for its reply), held in place or in the ring, and the updates stay
    torch's bits."""
    torch.manual_seed(2 + ring_layers)
    model = TinyMoE(torch.float32)
    ref = copy.deepcopy(model)
    experts = [p.numel() * 4 for n, p in model.named_parameters() if "layers.0.mlp.experts" in n]
    if not zero_copy:  # a ring slot takes more than its gradient (page and cache-line padding)
        experts = [Ring.slot_bytes(b) for b in experts]
    # 0: the hook that sends a layer's request waits for it, so one layer at most is held (it
    # gathers before its request; the ring keeps one layer too)
    bound = max(ring_layers, 1) * sum(experts)
    opt = sonar_moe.SonarAdamW(model, lr=1e-3, ring_layers=ring_layers, zero_copy=zero_copy)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    try:
        train_beside(model, ref, opt, topt, lambda: torch.randn(5, 9), steps=3)
        st = opt.stats()
        assert st["zero_copy"] is zero_copy and st["ring_layers"] == ring_layers
        if zero_copy:
            assert 0 < st["peak_expert_grad_bytes"] <= bound
        else:  # the ring, plus autograd's gradient while it is copied into its slot
            assert bound <= st["ring_bytes"] < bound + PAGE
            assert 0 < st["peak_expert_grad_bytes"] <= bound + max(p.numel() * 4 for p in model.parameters())
        assert_same_params(model, ref)
    finally:
        opt.close()


def test_ring_layers_default_follows_the_cores() -> None:
    """Unset, ring_layers is 0 (a hook waits for the update it sent) where torch's threads take every
    core this process may use, so the private server's work cannot overlap backward, and 1 where
    a core is left over (docs/benchmarks.md, "How many gradients wait")."""
    cores, saved = len(os.sched_getaffinity(0)), torch.get_num_threads()
    cases = [(cores, 0)] + ([(cores - 1, 1)] if cores > 1 else [])
    try:
        for threads, want in cases:
            torch.set_num_threads(threads)
            with sonar_moe.SonarAdamW(TinyMoE(torch.float32), lr=1e-3) as opt:
                assert opt.stats()["ring_layers"] == want, threads
    finally:
        torch.set_num_threads(saved)


def test_private_server_workers_follow_the_spare_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private sonard updates with the cores torch's threads leave free (one per core where torch
    takes them all), unless SONAR_WORKERS says otherwise (docs/benchmarks.md, "With a core to
    spare")."""
    cores, saved = len(os.sched_getaffinity(0)), torch.get_num_threads()
    monkeypatch.delenv("SONAR_WORKERS", raising=False)
    cases = [(cores, cores)] + ([(cores - 1, 1)] if cores > 1 else [])
    try:
        for threads, want in cases:
            torch.set_num_threads(threads)
            with sonar_moe.SonarAdamW(TinyMoE(torch.float32), lr=1e-3) as opt:
                assert opt.stats()["server_workers"] == want, threads
        monkeypatch.setenv("SONAR_WORKERS", "3")
        with sonar_moe.SonarAdamW(TinyMoE(torch.float32), lr=1e-3) as opt:
            assert opt.stats()["server_workers"] == 3
    finally:
        torch.set_num_threads(saved)
    assert [private_workers(t, 4) for t in (1, 3, 4, 8)] == [3, 1, None, None]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_ring_layers_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="ring_layers"):
        sonar_moe.SonarAdamW(TinyMoE(torch.float32), ring_layers=bad)  # type: ignore[arg-type]


@pytest.fixture()
def rig() -> Iterator[tuple[sonar_moe.Connection, Segment, int, int]]:
    """A raw session: one float32 tensor in shared memory, stepped once."""
    conn = start_private_server(timeout=10.0)
    conn.call("hello", {"client": "test", "pid": 0, "torch": torch.__version__, "threads": 1, "capability": ""})
    params = Segment(8192, "p")
    params.tensor(0, torch.float32, (N,)).copy_(torch.randn(N))
    pseg = conn.call("attach", {"shm": params.name, "size": params.size})["seg"]
    tid = conn.call("register", {"tensors": [{"name": "w", "shape": [N], "dtype": "float32",
                                              "param": {"seg": pseg, "off": 0, "nbytes": 4 * N}, "hyper": HYPER}]})["ids"][0]
    yield conn, params, pseg, tid
    conn.shutdown()


def probe_call(conn: sonar_moe.Connection, probe: bytes, addr: int) -> dict:
    return conn.call("attach_process", {"probe_addr": addr, "probe": probe})


def mapped_page_then_hole() -> int:
    """An address 100 bytes before the end of a mapped page whose next page is unmapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = 4096
    base = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + page, page) == 0
    ctypes.memset(base, 1, page)
    return base + page - 100


def test_bad_addresses_change_nothing(rig: tuple[sonar_moe.Connection, Segment, int, int]) -> None:
    """A gradient at an unmapped address, or running past a mapping, is refused before the
    update: the parameter and the step count are untouched and the tensor stays usable."""
    conn, params, _, tid = rig
    probe = secrets.token_bytes(64)
    buf = ctypes.create_string_buffer(probe, len(probe))
    seg = probe_call(conn, probe, ctypes.addressof(buf))["seg"]
    grad = torch.randn(N)

    def step(addr: int, step: int) -> None:
        conn.call("step", {"items": [{"tensor": tid, "grad": {"seg": seg, "off": addr, "nbytes": 4 * N}, "apply": True,
                                      "step": step, "scalars": torch_scalars(GROUP, float(step))}]})

    step(grad.data_ptr(), 1)  # a good one first
    before = bytes(params.mm[: 4 * N])
    edge = mapped_page_then_hole()  # the last 100 bytes of a mapped page; a hole after it
    for addr, why in [(8, "not mapped"), (1 << 46, "not mapped"), (grad.data_ptr() + 2, "aligned"),
                      (edge, "not mapped")]:
        with pytest.raises(SonarError, match=why):
            step(addr, 2)
        assert bytes(params.mm[: 4 * N]) == before
    step(grad.data_ptr(), 2)  # the tensor still takes updates
    assert bytes(params.mm[: 4 * N]) != before


def test_only_the_connected_process(rig: tuple[sonar_moe.Connection, Segment, int, int]) -> None:
    """The server reads the process at the other end of the connection (SO_PEERCRED), not one
    the client names: a probe that lives in another process is not found."""
    conn, _, _, _ = rig
    code = textwrap.dedent("""
        import ctypes, secrets, sys, time
        p = secrets.token_bytes(64)
        b = ctypes.create_string_buffer(p, 64)
        print(ctypes.addressof(b), p.hex(), flush=True)
        sys.stdin.readline()
    """)
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None  # stdout=PIPE
    try:
        addr, hexprobe = other.stdout.readline().split()
        with pytest.raises(SonarError, match="does not hold the probe|not mapped"):
            probe_call(conn, bytes.fromhex(hexprobe), int(addr))
    finally:
        other.communicate("\n")
    with pytest.raises(SonarError, match="probe of 3 bytes"):
        probe_call(conn, b"abc", 4096)

