"""PyTorch Lightning training of a tiny OLMoE with SonarAdamW or torch's AdamW, for
tests/test_lightning.py: in the test's process (``fit``), or as a script that Lightning's
launcher runs once per rank (``python tests/lightning_worker.py OUT OPTIMIZER STRATEGY ACCUMULATE``).

The module is written as a Lightning user writes one: ``configure_optimizers`` returns the
optimizer, Lightning calls ``zero_grad``, ``backward`` and ``step(closure)`` (and clips with
``gradient_clip_val``); nothing in it knows about the server."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "examples", ROOT / "pyclient"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import sonar_moe  # noqa: E402
from hf_util import Windows, tiny_olmoe  # noqa: E402

LR = 1e-3
WEIGHT_DECAY = 0.05
Precision = Literal["32-true", "bf16-true", "bf16-mixed"]


@dataclass(frozen=True)
class Options:
    """What one training run uses.

    optimizer: "sonar" (SonarAdamW) or "torch" (torch.optim.AdamW over all parameters).
    dense_clip: for "torch", clip the dense gradients to this global norm before each step
      (the reference of SonarAdamW's max_grad_norm); for "sonar", pass it as max_grad_norm.
    lightning_clip: Lightning's own gradient_clip_val.
    """

    optimizer: str
    precision: Precision = "32-true"
    accumulate: int = 1
    max_steps: int = -1
    max_epochs: int = 1
    windows: int = 16
    dense_clip: float | None = None
    lightning_clip: float | None = None
    devices: int = 1
    strategy: str = "auto"


class TinyOlmoeModule(L.LightningModule):
    def __init__(self, opts: Options) -> None:
        super().__init__()
        self.opts = opts
        self.model = tiny_olmoe("eager", seed=0, num_layers=2)
        self.dense_norms: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.opts.optimizer == "torch" and self.opts.dense_clip is not None:
            dense = [p for n, p in self.model.named_parameters() if ".experts." not in n]
            self.dense_norms.append(float(torch.nn.utils.clip_grad_norm_(dense, self.opts.dense_clip)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.opts.optimizer == "torch":
            return torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        return sonar_moe.SonarAdamW(self.model, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=self.opts.dense_clip,
                                    grad_accumulation_steps=self.trainer.accumulate_grad_batches)


def trainer(opts: Options) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=opts.devices, strategy=opts.strategy, precision=opts.precision,
                     max_steps=opts.max_steps, max_epochs=opts.max_epochs, accumulate_grad_batches=opts.accumulate,
                     gradient_clip_val=opts.lightning_clip, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def data(opts: Options) -> DataLoader[dict[str, torch.Tensor]]:
    return DataLoader(Windows(n=opts.windows, seq=24, seed=5), batch_size=2, shuffle=False)


def close(trainer_: L.Trainer) -> None:
    """Lightning leaves the optimizer open: end its session as a script would at the end."""
    for opt in trainer_.optimizers:
        if isinstance(opt, sonar_moe.SonarAdamW):
            opt.close()


def fit(opts: Options, *, ckpt_path: str | None = None, save_to: str | None = None,
        keep_open: bool = False) -> tuple[TinyOlmoeModule, L.Trainer]:
    """Train in this process; with save_to, write Lightning's checkpoint there at the end."""
    module = TinyOlmoeModule(opts)
    tr = trainer(opts)
    tr.fit(module, data(opts), ckpt_path=ckpt_path)
    if save_to is not None:
        tr.save_checkpoint(save_to)
    if not keep_open:
        close(tr)
    return module, tr


def parameters(module: TinyOlmoeModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def main() -> None:
    out, optimizer, strategy, accumulate = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    opts = Options(optimizer=optimizer, accumulate=accumulate, max_steps=4, windows=32, devices=2,
                   strategy=strategy)
    module, tr = fit(opts)
    if tr.global_rank == 0:
        torch.save(parameters(module), out)
    print(f"rank {tr.global_rank} of {tr.world_size} pid {os.getpid()} done", flush=True)


if __name__ == "__main__":
    main()
