"""What seeing whether gradients were zeroed between steps costs (sonar_moe/_zeroing.py).

SonarAdamW notes the dense gradients each step() applied (the tensor, held weakly, and its
version) and looks at them again when the next step's backward starts and at step(). This
times that work on the real models' numbers of dense tensors (OLMoE-1B-7B: 16 layers,
Granite-3.1-3B-A800M: 32; the tensors are small, as the work is per tensor, not per byte)
against the dense step torch's AdamW makes over the same tensors in the same run; and the
forward hook that hooks the output's gradient (once per forward) of a real SonarAdamW
(sonard from $SONARD or PATH), after a step (a loop that zeroes with model.zero_grad(), as
Trainer does: a hook is registered) and after opt.zero_grad() (nothing to look at); and the
look for the module that runs the model after a step where no hook saw backward start
(ModelOutputs: a global forward pre-hook armed, then the model's pre-hook finds it and removes
it), against the same call with nothing armed.

    cd bench && PYTHONPATH=../pyclient python zeroing.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import warnings
import weakref

import torch

import sonar_moe
from models import is_expert, small_shape
from sonar_moe._zeroing import AppliedGrads, ModelOutputs
from sonar_moe.optimizer import _output_hook


def median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | dense tensors | note the step's gradients, us | look at them (zeroed), us | "
          "torch AdamW dense step (foreach), us | ratio | forward hook after a step / after opt.zero_grad(), us | "
          "looking for the model after a step, us |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, layers in (("olmoe", 16), ("granite", 32)):
        shape, _, _ = small_shape(kind, 64, layers)
        model = shape.build("grouped_mm", torch.float32, 0)
        dense = [p for n, p in model.named_parameters() if not is_expert(n, p)]
        for p in dense:
            p.grad = torch.randn_like(p)
        adamw = torch.optim.AdamW(dense, foreach=True)
        adamw.step()  # the state exists: later steps are the steady ones
        step_us = median_us(adamw.step, args.repeats)
        note_us = median_us(lambda: AppliedGrads(dense, True), args.repeats)
        applied = AppliedGrads(dense, True)
        model.zero_grad()  # the usual case: every gradient gone, so every tensor is looked at

        def look() -> None:
            applied.still_held()
            applied.zeroed_in_place()

        look_us = median_us(look, args.repeats)
        hook_us = forward_hook_us(model, args.repeats)
        find_us = finding_us(model, args.repeats)
        print(f"| {kind} ({layers} layers) | {len(dense)} | {note_us:.1f} | {look_us:.1f} | {step_us:.0f} | "
              f"{(note_us + look_us) / step_us:.4f} | {hook_us[0]:.1f} / {hook_us[1]:.1f} | {find_us:.1f} |")


class Holder(torch.nn.Module):
    """Holds the model (its parameters are Holder's) and does nothing when called: what finding
    it costs is all there is to time."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def finding_us(model: torch.nn.Module, repeats: int) -> float:
    """ModelOutputs.arm() and the next module call that finds the model, minus the same call
    with nothing armed (the found module is hooked once, at the first repeat, as in training)."""
    experts = {id(p) for n, p in model.named_parameters() if is_expert(n, p)}
    outputs = ModelOutputs(lambda module, args, output: None,
                           lambda module: any(id(p) in experts for p in module.parameters()))
    holder, x = Holder(model), torch.zeros(1)

    def armed() -> None:
        outputs.arm()
        holder(x)

    try:
        return median_us(armed, repeats) - median_us(lambda: holder(x), repeats)
    finally:
        outputs.close()


def forward_hook_us(model: torch.nn.Module, repeats: int) -> tuple[float, float]:
    """The output hook of a SonarAdamW on ``model``: after a step, then after opt.zero_grad()."""
    x = torch.randint(0, 256, (1, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = sonar_moe.SonarAdamW(model)
    with opt:
        model.zero_grad()
        model(x, labels=x).loss.backward()
        opt.step()
        out = model(x, labels=x)
        hook = _output_hook(weakref.ref(opt))
        after_step = median_us(lambda: hook(model, (x,), out), repeats)
        opt.zero_grad()
        after_zero_grad = median_us(lambda: hook(model, (x,), out), repeats)
    return after_step, after_zero_grad


if __name__ == "__main__":
    main()
