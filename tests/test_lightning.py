"""PyTorch Lightning runs SonarAdamW as it runs any optimizer, and the parameters come out
bit for bit those of torch's AdamW under the same Lightning Trainer: Lightning calls
``step(closure)`` with the forward and backward inside the closure, accumulates micro-batches
itself (its last step of an epoch may have fewer), clips with ``gradient_clip_val`` between
backward and step, saves and restores the optimizer through ``state_dict``, and under
``strategy="ddp"`` wraps the model in DDP after the optimizer exists. Each of these is a place
where a drop-in optimizer could train differently without an error; the runs are in
tests/lightning_worker.py."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import sonar_moe
from lightning_worker import Options, Precision, TinyOlmoeModule, close, data, fit, parameters, trainer

WORKER = Path(__file__).resolve().parent / "lightning_worker.py"


def assert_same(ref: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], where: str) -> None:
    assert ref.keys() == mine.keys()
    bad = [n for n in ref if not torch.equal(ref[n], mine[n])]
    assert not bad, f"{where}: {len(bad)} of {len(ref)} tensors differ from torch's, first {bad[:3]}"


def assert_trained(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> None:
    """Every expert tensor and most others moved, so equality is not that of untouched models
    (in bfloat16 an update of a norm's weights of 1.0 is below its rounding step)."""
    still = [n for n in start if torch.equal(start[n].to(end[n].dtype), end[n])]
    assert not [n for n in still if ".experts." in n], f"experts not trained: {still}"
    assert len(still) < len(start) // 2, f"not trained: {still}"


@pytest.mark.parametrize(("precision", "accumulate"), [("32-true", 1), ("32-true", 3), ("bf16-true", 1),
                                                       ("bf16-true", 3), ("bf16-mixed", 2)])
def test_lightning_trainer_is_bitwise_torch_adamw(precision: Precision, accumulate: int) -> None:
    """accumulate 3 over 8 batches an epoch for 2 epochs: steps of 3, 3 and 2 micro-batches
    (Lightning steps at the end of an epoch with what it has), which SonarAdamW's step()
    applies as torch does."""
    opts = Options(optimizer="torch", precision=precision, accumulate=accumulate,
                   max_steps=5 if accumulate == 1 else -1, max_epochs=1 if accumulate == 1 else 2)
    start = parameters(TinyOlmoeModule(opts))
    ref, ref_tr = fit(opts)
    mine, tr = fit(replace(opts, optimizer="sonar"))
    assert tr.global_step == ref_tr.global_step == {1: 5, 2: 8, 3: 6}[accumulate]
    assert_trained(start, parameters(ref))
    assert_same(parameters(ref), parameters(mine), f"{precision}, accumulate_grad_batches={accumulate}")


def test_lightning_gradient_clip_val_clips_the_dense_gradients() -> None:
    """Lightning's gradient_clip_val clips model.parameters() after backward, when the expert
    gradients have been applied and dropped: it clips the dense gradients by their own norm,
    which is SonarAdamW's max_grad_norm, bit for bit (and the reference: torch's AdamW after
    clip_grad_norm_ over the dense parameters)."""
    clip = 0.05
    ref, _ = fit(Options(optimizer="torch", max_steps=4, dense_clip=clip))
    assert max(ref.dense_norms) > clip, f"the dense gradients' norms {ref.dense_norms} were never clipped"
    by_option, _ = fit(Options(optimizer="sonar", max_steps=4, dense_clip=clip))
    by_lightning, _ = fit(Options(optimizer="sonar", max_steps=4, lightning_clip=clip))
    assert_same(parameters(ref), parameters(by_option), "max_grad_norm")
    assert_same(parameters(ref), parameters(by_lightning), "Lightning's gradient_clip_val")


def test_lightning_resume_from_checkpoint_is_bitwise(tmp_path: Path) -> None:
    """Three steps, Lightning's checkpoint, a new module, Trainer and optimizer resumed to six:
    equal to torch doing the same, and torch's AdamW resumes from SonarAdamW's checkpoint
    to the same bits (the optimizer state in it is torch's format)."""
    first = Options(optimizer="torch", max_steps=3, max_epochs=3)
    fit(first, save_to=str(tmp_path / "torch.ckpt"))
    fit(replace(first, optimizer="sonar"), save_to=str(tmp_path / "sonar.ckpt"))
    again = replace(first, max_steps=6)
    ref, ref_tr = fit(again, ckpt_path=str(tmp_path / "torch.ckpt"))
    mine, tr = fit(replace(again, optimizer="sonar"), ckpt_path=str(tmp_path / "sonar.ckpt"))
    crossed, _ = fit(again, ckpt_path=str(tmp_path / "sonar.ckpt"))
    assert tr.global_step == ref_tr.global_step == 6
    assert_same(parameters(ref), parameters(mine), "SonarAdamW resumed")
    assert_same(parameters(ref), parameters(crossed), "torch's AdamW resumed from SonarAdamW's checkpoint")


class UndeclaredAccumulation(TinyOlmoeModule):
    """accumulate_grad_batches=2 given to Lightning but not to SonarAdamW."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sonar_moe.SonarAdamW(self.model, lr=1e-3)


def test_lightning_accumulation_not_given_to_sonar_is_refused() -> None:
    """Lightning's second micro-batch would be a second update during backward: refused,
    naming the option to set."""
    opts = Options(optimizer="sonar", accumulate=2, max_steps=2)
    module = UndeclaredAccumulation(opts)
    tr = trainer(opts)
    try:
        with pytest.raises(RuntimeError, match=r"grad_accumulation_steps=1.*accumulate_grad_batches"):
            tr.fit(module, data(opts))
    finally:
        close(tr)


@pytest.mark.timeout(600)
def test_lightning_ddp_two_processes_is_bitwise(tmp_path: Path) -> None:
    """strategy="ddp" on two CPU processes (Lightning's launcher starts the second; gloo),
    accumulate_grad_batches=2 (Lightning accumulates under no_sync): SonarAdamW finds the DDP
    wrapping itself, and rank 0's parameters equal those of the same run with torch's AdamW."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = {}
    for optimizer in ("torch", "sonar"):
        out[optimizer] = tmp_path / f"{optimizer}.pt"
        run = subprocess.run([sys.executable, str(WORKER), str(out[optimizer]), optimizer, "ddp", "2"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=540)
        assert run.returncode == 0, f"{optimizer}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        assert run.stdout.count(" of 2 pid ") == 2, run.stdout[-3000:]
    assert_same(torch.load(out["torch"]), torch.load(out["sonar"]), "DDP, 2 processes")


@pytest.mark.parametrize("clip", [None, 0.05])
def test_fabric_loop_is_bitwise_torch_adamw(clip: float | None) -> None:
    """Lightning Fabric: ``fabric.setup(model, optimizer)`` wraps SonarAdamW, ``fabric.backward``
    runs the hooks, bf16-mixed autocast; ``fabric.clip_gradients`` after backward clips the dense
    gradients by their own norm, the reference's clip_grad_norm_ over the dense parameters."""
    from lightning.fabric import Fabric

    from hf_util import text_batches, tiny_olmoe

    runs = {}
    for name in ("torch", "sonar"):
        fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
        model = tiny_olmoe("eager", seed=0, num_layers=2)
        opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if name == "torch"
                                      else sonar_moe.SonarAdamW(model, lr=1e-3))
        fmodel, fopt = fabric.setup(model, opt)
        dense = [p for n, p in model.named_parameters() if ".experts." not in n]
        norms = []
        for b in text_batches(1, count=4):
            fopt.zero_grad()
            fabric.backward(fmodel(**b).loss)
            if clip is not None:
                if name == "torch":
                    norms.append(float(torch.nn.utils.clip_grad_norm_(dense, clip)))
                else:
                    fabric.clip_gradients(fmodel, fopt, max_norm=clip)
            fopt.step()
        if clip is not None and name == "torch":
            assert max(norms) > clip, norms
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if isinstance(opt, sonar_moe.SonarAdamW):
            opt.close()
    assert_same(runs["torch"], runs["sonar"], f"Fabric, clip {clip}")
