"""Atomic, checksummed checkpoints: round trip with a resume that is bit for bit, and clear
errors for truncated, corrupted and foreign files; torch.distributed.checkpoint's state-dict
API and its save/load, as torchtitan-style scripts checkpoint."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

import sonar_moe
import tiny_moe as tm
from sonar_moe import CheckpointError, load_checkpoint, save_checkpoint


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    data = tm.batches(tm.load_corpus(50_000), 2, 16, torch.Generator().manual_seed(seed))
    for _ in range(steps):
        x = next(data)
        loss, _ = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_round_trip_and_resume(tmp_path: Path) -> None:
    cfg = tm.MoEConfig(num_layers=2, num_experts=4)
    full, part = tm.build(cfg, 1), tm.build(cfg, 1)
    with sonar_moe.SonarAdamW(full, lr=1e-3) as opt:
        _train(full, opt, 3, seed=1)
        _train(full, opt, 3, seed=2)
    path = tmp_path / "ck.pt"
    with sonar_moe.SonarAdamW(part, lr=1e-3) as opt:
        _train(part, opt, 3, seed=1)
        save_checkpoint(path, {"model": part.state_dict(), "opt": opt.state_dict()})
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind
    ck = load_checkpoint(path)
    resumed = tm.build(cfg, 77)
    resumed.load_state_dict(ck["model"])
    with sonar_moe.SonarAdamW(resumed, lr=1e-3) as opt:  # a new sonard
        opt.load_state_dict(ck["opt"])
        _train(resumed, opt, 3, seed=2)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage,match", [
    ("truncate", "truncated|too short"),
    ("flip", "checksum"),
    ("extend", "extended|truncated"),
    ("empty", "too short"),
    ("foreign", "not a Sonar checkpoint"),
])
def test_damaged_checkpoint_gives_a_clear_error(tmp_path: Path, damage: str, match: str) -> None:
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"w": torch.randn(1000)})
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "extend":
        data += b"\0" * 10
    elif damage == "empty":
        data = bytearray()
    else:
        import io
        buf = io.BytesIO()
        torch.save({"w": 1}, buf)
        data = bytearray(buf.getvalue())
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_failed_save_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"v": 1})

    class Unpicklable:
        def __reduce__(self) -> NoReturn:  # noqa: D105
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(path, {"v": Unpicklable()})
    assert load_checkpoint(path) == {"v": 1}
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]


KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {pyclient!r})
from sonar_moe import save_checkpoint
real_fsync = os.fsync
def fsync(fd):  # the temporary file is written; die before it is renamed
    os.kill(os.getpid(), signal.{sig})
    real_fsync(fd)
os.fsync = fsync
save_checkpoint({path!r}, {{"v": 2}})
print("survived")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_killed_save_leaves_no_temporary_behind(tmp_path: Path, sig: str) -> None:
    """Issue 16 (c): a save killed while writing. SIGTERM (no handler of the program's own):
    the temporary file is removed, then the process dies of the signal as it would have.
    SIGKILL cannot be caught: its temporary is removed by the next save of that checkpoint.
    The old checkpoint is intact either way."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"v": 1})
    script = KILLED_SAVE.format(pyclient=str(Path(sonar_moe.__file__).parents[1]), sig=sig, path=str(path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -getattr(signal, sig), (r.returncode, r.stdout, r.stderr[-2000:])
    assert load_checkpoint(path) == {"v": 1}
    left = sorted(os.listdir(tmp_path))
    if sig == "SIGTERM":
        assert left == ["ck.pt"]
        return
    assert len(left) == 2 and left[0].startswith(".ck.pt.sonar-tmp-"), left
    save_checkpoint(path, {"v": 3})  # the next save removes the dead process's temporary
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]
    assert load_checkpoint(path) == {"v": 3}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process says so
def test_torch_distributed_checkpoint_is_torchs(tmp_path: Path) -> None:
    """torch.distributed.checkpoint on one process: get_optimizer_state_dict of a fresh
    optimizer (DCP makes its state with a step of zero gradients at lr=0) leaves the parameters
    alone and gives torch's state; after training, the state-dict API, dcp.save and dcp.load into
    a new model and SonarAdamW, and set_state_dict resume bit for bit as torch's AdamW does from
    its own checkpoint."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

    cfg = tm.MoEConfig(num_layers=2, num_experts=4)
    hp: dict[str, Any] = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))

    def pair(seed: int) -> tuple[torch.nn.Module, sonar_moe.SonarAdamW, torch.nn.Module, torch.optim.AdamW]:
        model = tm.build(cfg, seed)
        ref = copy.deepcopy(model)
        return model, sonar_moe.SonarAdamW(model, **hp), ref, torch.optim.AdamW(ref.parameters(), **hp)

    def assert_same(a: dict, b: dict, where: str) -> None:
        assert a["state"].keys() == b["state"].keys(), where
        for k, st in b["state"].items():
            for kk, v in st.items():
                assert torch.equal(a["state"][k][kk], v), f"{where}: {k} {kk}"

    def assert_params(mine: torch.nn.Module, torchs: torch.nn.Module, where: str) -> None:
        bad = [n for (n, a), b in zip(torchs.named_parameters(), mine.parameters()) if not torch.equal(a, b)]
        assert not bad, f"{where}: {bad[:3]}"

    model, opt, ref, ropt = pair(1)
    assert_same(get_optimizer_state_dict(model, opt), get_optimizer_state_dict(ref, ropt), "fresh")
    assert_params(model, ref, "after DCP initialised the state")
    for seed in (1, 2):
        _train(model, opt, 2, seed)
        _train(ref, ropt, 2, seed)
    assert_params(model, ref, "trained")
    assert_same(get_optimizer_state_dict(model, opt), get_optimizer_state_dict(ref, ropt), "trained")
    for name, (m, o) in {"sonar": (model, opt), "torch": (ref, ropt)}.items():
        msd, osd = get_state_dict(m, o)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / name)
    opt.close()

    model, opt, ref, ropt = pair(7)  # other weights: all of it comes from the checkpoints
    with opt:
        for name, (m, o) in {"sonar": (model, opt), "torch": (ref, ropt)}.items():
            msd, osd = get_state_dict(m, o)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path / name)  # in place
            set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
        assert_params(model, ref, "loaded")
        _train(model, opt, 3, seed=3)
        _train(ref, ropt, 3, seed=3)
        assert_params(model, ref, "resumed")
