"""Hugging Face Trainer integration: ``SonarTrainer`` is ``transformers.Trainer`` with SonarAdamW.

One line changes in a training script::

    trainer = SonarTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)

The optimizer is built from the ``TrainingArguments`` as ``Trainer.create_optimizer`` builds
torch's: ``args.optim`` (``adamw_torch`` or ``adamw_torch_fused``, Trainer's default with
torch >= 2.8), learning_rate, adam_beta1/2, adam_epsilon, and two parameter groups, weight
decay on the parameters ``Trainer.get_decay_parameter_names`` names and none on the others
(biases, norm weights); plus max_grad_norm and gradient_accumulation_steps.

Clipping: Trainer's own clipping would run after backward, when the expert gradients are
already applied and freed, so it would silently clip the dense parameters only. SonarTrainer
replaces Trainer's clipping hook (``_clip_grad_norm``) with nothing and lets SonarAdamW clip
the dense parameters to ``args.max_grad_norm`` in ``step()``; the caller's ``TrainingArguments``
are not changed (the saved ``training_args.bin`` shows what was asked for, and the same object
gives a stock Trainer its usual clipping).

Logs: ``dense_grad_norm`` is the norm of the dense gradients before clipping (what SonarAdamW
clips). Trainer's ``grad_norm`` (the norm over all gradients) is not logged: the expert
gradients are applied and freed during backward, and with gradient accumulation only sonard
holds their sum, so the global norm would cost an extra pass over every expert gradient and a
reduction on the server. ``sonar_peak_expert_grad_bytes`` and ``sonar_update_ms_p50`` come
from SonarAdamW's statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, Trainer

from .optimizer import SonarAdamW

# args.optim values SonarTrainer reproduces, and the AdamW flags each one means in Trainer.
SUPPORTED_OPTIM = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}


def unwrap_sonar(optimizer: Any) -> SonarAdamW | None:
    """The SonarAdamW inside an optimizer wrapper (accelerate's AcceleratedOptimizer), if any."""
    seen = 0
    while optimizer is not None and seen < 4:
        if isinstance(optimizer, SonarAdamW):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


class SonarTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is SonarAdamW (see the module docstring).

    ``sonar_kwargs`` are passed on to SonarAdamW (e.g. ``server=``, ``max_expert_grad_norm=``,
    ``expert_params=``).
    """

    def __init__(self, *args: Any, sonar_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sonar_kwargs = dict(sonar_kwargs or {})
        self._unclipped_dense_norm: float | None = None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            a = self.args
            optim = str(getattr(a.optim, "value", a.optim))
            if optim not in SUPPORTED_OPTIM:
                raise ValueError(f"SonarTrainer reproduces TrainingArguments.optim {sorted(SUPPORTED_OPTIM)} "
                                 f"(torch.optim.AdamW), not {optim!r}")
            if a.optim_args:
                raise ValueError(f"SonarTrainer does not take TrainingArguments.optim_args ({a.optim_args!r}): "
                                 "pass SonarAdamW options through sonar_kwargs=")
            target = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(target))
            named = [(n, p) for n, p in target.named_parameters() if p.requires_grad]
            groups = [  # as Trainer.create_optimizer groups them
                {"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            self.optimizer = SonarAdamW(
                groups,
                lr=a.learning_rate,
                betas=(a.adam_beta1, a.adam_beta2),
                eps=a.adam_epsilon,
                max_grad_norm=float(a.max_grad_norm) if a.max_grad_norm and a.max_grad_norm > 0 else None,
                grad_accumulation_steps=a.gradient_accumulation_steps,
                model=target,
                **{**SUPPORTED_OPTIM[optim], **self.sonar_kwargs},
            )
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """Trainer's clipping, which runs after backward: with SonarAdamW nothing is clipped
        here (the expert gradients are already applied; SonarAdamW clips the dense ones in
        step()), and no norm is returned."""
        if unwrap_sonar(self.optimizer) is None:
            return super()._clip_grad_norm(model)
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """Trainer's ``grad_norm`` (the norm over all gradients) is not available with SonarAdamW
        (see the module docstring), so it is not logged. Where SonarAdamW does not clip, the
        dense norm Trainer would measure is measured here the same way, for ``dense_grad_norm``
        (only dense parameters have a gradient at this point)."""
        opt = unwrap_sonar(self.optimizer)
        if opt is None:
            return super()._get_grad_norm(model, grad_norm)
        if opt.max_grad_norm is None:
            norm = super()._get_grad_norm(model, None)
            self._unclipped_dense_norm = float(norm) if norm is not None else None
        return None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = unwrap_sonar(self.optimizer)
        if opt is not None and "loss" in logs:
            if opt.max_grad_norm is not None and opt.last_dense_grad_norm is not None:
                logs["dense_grad_norm"] = float(opt.last_dense_grad_norm)
            elif opt.max_grad_norm is None and self._unclipped_dense_norm is not None:
                logs["dense_grad_norm"] = self._unclipped_dense_norm
            st = opt.stats(server=False)
            logs["sonar_peak_expert_grad_bytes"] = st["peak_expert_grad_bytes"]
            logs["sonar_update_ms_p50"] = round(st["latency_ms_p50"], 3)
        super().log(logs, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Trainer's loader, plus a reload through ``from_pretrained``.

        transformers 5.x saves batched expert tensors (OLMoE ``mlp.experts.gate_up_proj``) in the
        per-expert checkpoint layout, and ``Trainer._load_from_checkpoint`` loads with
        ``strict=False`` without converting back, so the experts silently keep their current
        values on resume. ``from_pretrained`` applies the conversion; its weights are copied in
        place, so parameters living in Sonar's shared memory stay where they are.
        """
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = model if model is not None else self.model
        if isinstance(target, PreTrainedModel):
            fresh = type(target).from_pretrained(resume_from_checkpoint, dtype=target.dtype)
            with torch.no_grad():
                target.load_state_dict(fresh.state_dict(), strict=True)
            del fresh
