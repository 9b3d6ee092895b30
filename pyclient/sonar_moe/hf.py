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
from SonarAdamW's statistics. With ``sonar_kwargs={"expert_clipping": "prev_global"}`` (or
``"running"``) the server measures every expert gradient as it applies it, so ``grad_norm`` (the
norm over all gradients, before clipping) is logged after all, with ``expert_grad_scale``, the
factor the step's expert gradients got.

Distributed (``torchrun``, ``accelerate launch``): nothing changes in the script. Trainer wraps
the model in DDP after building the optimizer; SonarAdamW notices at the first forward and takes
the all-reduced expert gradients from a DDP communication hook, bitwise equal to the same launch
with stock Trainer (gradient accumulation runs under ``no_sync`` as Trainer does). DDP's buckets
hold every expert gradient, so under DDP the memory saving is the expert optimizer state only;
expert parallel keeps the one-layer bound (docs/distributed.md). The ranks of a host share one
sonard. Under FSDP1 (Trainer's ``fsdp`` without ``fsdp_version: 2``) SonarAdamW warns that it
cannot update the expert tensors FSDP1 flattened, and steps them as torch does; Trainer then
clips as it does (FSDP1's own clipping, over every rank's shards), and logs its ``grad_norm``.

Checkpoints: resuming and ``load_best_model_at_end`` load the model's weights in place with the
checkpoint's layout converted back (``load_weights_in_place``): Trainer 5.23 loads them with
``strict=False`` and no conversion, so expert tensors, saved per expert, would keep their
current values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from accelerate.utils import DynamoBackend
from safetensors import safe_open
from transformers import PreTrainedModel, Trainer
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from ._fsdp1 import units as fsdp1_units
from .optimizer import SonarAdamW

log = logging.getLogger("sonar_moe")

# args.optim values SonarTrainer reproduces, and the AdamW flags each one means in Trainer.
SUPPORTED_OPTIM = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}
# The torch.optim.AdamW options an optimizer_cls_and_kwargs may set (weight_decay is the default
# of groups that, as Trainer builds them, all set their own).
ADAMW_OPTIONS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused"})


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

    ``sonar_kwargs`` are passed on to SonarAdamW (e.g. ``server=``, ``expert_clipping=``,
    ``max_expert_grad_norm=``, ``expert_params=``).
    """

    def __init__(self, *args: Any, sonar_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._built: SonarAdamW | None = None  # the last SonarAdamW create_optimizer built
        super().__init__(*args, **kwargs)
        self.sonar_kwargs = dict(sonar_kwargs or {})
        self._unclipped_dense_norm: float | None = None
        # Under FSDP1 SonarAdamW updates no expert tensor in backward (FSDP1 flattened them),
        # so Trainer's own clipping after backward is right, and FSDP1's (every rank's shards)
        self._trainer_clips = False

    @contextlib.contextmanager
    def _compiled_per_layer(self) -> Iterator[None]:
        """With ``torch_compile``, accelerate compiles the model while ``train()`` prepares it:
        meanwhile it compiles each decoder layer on its own (its regional compilation) instead of
        the whole model. The backward of one compiled graph gives all of its gradients at once,
        so a whole-model graph keeps every layer's expert gradients alive together, as without
        Sonar (measured: docs/results-history.md, 2026-12-06); per layer, backward finishes a
        layer's gradients before it starts the next. accelerate's plugin is shared by the
        process's Trainers: its setting is put back afterwards."""
        plugin = getattr(self.accelerator.state, "dynamo_plugin", None)
        if plugin is None or plugin.use_regional_compilation or plugin.backend == DynamoBackend.NO:
            yield
            return
        plugin.use_regional_compilation = True
        log.info("SonarTrainer compiles each decoder layer on its own (regional compilation): a whole-model graph "
                 "would keep the expert gradients of every layer alive until its backward ends")
        try:
            yield
        finally:
            plugin.use_regional_compilation = False

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            a = self.args
            adamw = self._requested_adamw(model if model is not None else self.model)
            target = model if model is not None else self.model
            if target is None:
                raise ValueError("SonarTrainer.create_optimizer needs a model: Trainer was built without one")
            decay = set(self.get_decay_parameter_names(target))
            named = [(n, p) for n, p in target.named_parameters() if p.requires_grad]
            groups = [  # as Trainer.create_optimizer groups them
                {"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            if self._built is not None and not self._built.closed:
                # Trainer dropped it (a new train() with model_init, hyperparameter_search):
                # its session, and its private sonard, go with it
                self._built.close()
            extra: dict[str, Any] = {}
            scaler = getattr(self.accelerator, "scaler", None)  # fp16 where accelerate scales the loss (CUDA)
            if scaler is not None and "grad_scaler" not in self.sonar_kwargs:
                if a.gradient_accumulation_steps > 1:
                    raise ValueError(
                        "SonarTrainer with fp16=True and gradient_accumulation_steps > 1: accelerate scales the "
                        "loss with a GradScaler, and SonarAdamW cannot take an overflowing micro-batch back out of "
                        "the expert gradients summed on the server. Use bf16=True (no loss scaling), or "
                        "gradient_accumulation_steps=1")
                extra["grad_scaler"] = scaler  # accelerate steps SonarAdamW through it (scaler.step)
            clip = float(a.max_grad_norm) if a.max_grad_norm and a.max_grad_norm > 0 else None
            self._trainer_clips = bool(fsdp1_units(target))
            opt = SonarAdamW(
                groups,
                max_grad_norm=None if self._trainer_clips else clip,
                grad_accumulation_steps=a.gradient_accumulation_steps,
                model=target,
                **{**adamw, **extra, **self.sonar_kwargs},
            )
            if self._trainer_clips and clip is not None and opt.named_expert_parameters():
                opt.close()
                raise ValueError("SonarTrainer under FSDP1 with expert tensors FSDP1 left unflattened "
                                 "(ignored_modules): Trainer's clipping after backward would miss their gradients, "
                                 "already applied. Set max_grad_norm=0, or shard with FSDP2")
            self.optimizer = self._built = opt
        return self.optimizer

    def _requested_adamw(self, model: torch.nn.Module | None) -> dict[str, Any]:
        """The torch.optim.AdamW options the stock Trainer would build its optimizer with: from
        ``optimizer_cls_and_kwargs``, an overridden ``get_optimizer_cls_and_kwargs``, or
        ``args.optim`` (SUPPORTED_OPTIM) and the args' AdamW fields; anything but AdamW refused."""
        a = self.args
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            where = "optimizer_cls_and_kwargs"
        elif type(self).get_optimizer_cls_and_kwargs is not Trainer.get_optimizer_cls_and_kwargs:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(a, model)  # type: ignore[arg-type]
            where = f"{type(self).__name__}.get_optimizer_cls_and_kwargs"
        else:
            optim = str(getattr(a.optim, "value", a.optim))
            if optim not in SUPPORTED_OPTIM:
                raise ValueError(f"SonarTrainer reproduces TrainingArguments.optim {sorted(SUPPORTED_OPTIM)} "
                                 f"(torch.optim.AdamW), not {optim!r}")
            if a.optim_args:
                raise ValueError(f"SonarTrainer does not take TrainingArguments.optim_args ({a.optim_args!r}): "
                                 "pass SonarAdamW options through sonar_kwargs=")
            return {"lr": a.learning_rate, "betas": (a.adam_beta1, a.adam_beta2), "eps": a.adam_epsilon,
                    **SUPPORTED_OPTIM[optim]}
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.AdamW)):
            raise ValueError(f"{where} names {getattr(cls, '__name__', cls)!r}: SonarTrainer trains with SonarAdamW, "
                             "which reproduces torch.optim.AdamW only; use the stock Trainer for that optimizer")
        unknown = sorted(set(kwargs) - ADAMW_OPTIONS)
        if unknown:
            raise ValueError(f"{where} passes {unknown} to AdamW: SonarAdamW takes {sorted(ADAMW_OPTIONS)} (and its "
                             "own options through sonar_kwargs=)")
        return dict(kwargs)  # torch.optim.AdamW's defaults for the rest, which SonarAdamW shares

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's train(), compiling each decoder layer on its own where ``torch_compile``
        is set (_compiled_per_layer); afterwards the optimizer counts micro-batches again (its
        ``grad_accumulation_steps``), for a script that goes on with it by hand."""
        try:
            with self._compiled_per_layer():
                return super().train(*args, **kwargs)
        finally:
            opt = unwrap_sonar(self.optimizer)
            if opt is not None and not opt.closed:
                opt.set_step_boundary(None)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Trainer's step, after telling SonarAdamW whether this backward completes the optimizer
        step, as Trainer decided (``accelerator.sync_gradients``): the expert updates then come
        with the backward Trainer steps after, however many micro-batches its step has."""
        opt = unwrap_sonar(self.optimizer)
        if opt is not None:
            opt.set_step_boundary(bool(self.accelerator.sync_gradients))
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """Trainer's clipping, which runs after backward: with SonarAdamW nothing is clipped
        here (the expert gradients are already applied; SonarAdamW clips the dense ones in
        step()), and no norm is returned."""
        if unwrap_sonar(self.optimizer) is None or self._trainer_clips:
            return super()._clip_grad_norm(model)
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """Trainer's ``grad_norm`` (the norm over all gradients) is not available with SonarAdamW
        (see the module docstring), so it is not logged. Where SonarAdamW does not clip, the
        dense norm Trainer would measure is measured here the same way, for ``dense_grad_norm``
        (only dense parameters have a gradient at this point)."""
        opt = unwrap_sonar(self.optimizer)
        if opt is None or self._trainer_clips:
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
            if opt.last_global_grad_norm is not None:  # expert_clipping: the server measured the experts' norms
                logs["grad_norm"] = opt.last_global_grad_norm
                scale = opt.last_expert_grad_scale
                if scale is not None:
                    logs["expert_grad_scale"] = scale
            st = opt.stats(server=False)
            logs["sonar_peak_expert_grad_bytes"] = st["peak_expert_grad_bytes"]
            logs["sonar_update_ms_p50"] = round(st["latency_ms_p50"], 3)
        super().log(logs, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Trainer's loader, except for a plain ``PreTrainedModel`` with a safetensors or
        ``pytorch_model.bin`` checkpoint: that is loaded in place with the checkpoint layout
        converted (see ``load_weights_in_place``). Trainer 5.23 loads with ``strict=False`` and no
        conversion, so batched expert tensors (saved per expert) and renamed weights (GraniteMoe's
        router) would silently keep their current values, with a missing/unexpected-keys warning."""
        target = model if model is not None else self.model
        if not self._loads_in_place(target, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        report_load(load_weights_in_place(target, resume_from_checkpoint), resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """Trainer's ``load_best_model_at_end``, with the same in-place, converting load as resume."""
        best = self.state.best_model_checkpoint
        if best is None or not self._loads_in_place(self.model, best):
            super()._load_best_model()
            return
        log.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        report_load(load_weights_in_place(self.model, best), best)

    def _loads_in_place(self, model: torch.nn.Module | None, checkpoint: str) -> TypeGuard[PreTrainedModel]:
        """Whether SonarTrainer loads this checkpoint itself: a plain (not PEFT-wrapped)
        PreTrainedModel, neither FSDP nor DeepSpeed, and a checkpoint of one safetensors file,
        sharded safetensors or one pytorch_model.bin. Other cases keep Trainer's loader."""
        return (isinstance(model, PreTrainedModel) and not hasattr(model, "peft_config")
                and not self.is_fsdp_enabled and not self.is_deepspeed_enabled
                and checkpoint_files(checkpoint) is not None)


def checkpoint_files(checkpoint: str) -> dict[str, str] | None:
    """{checkpoint key: file} of a model checkpoint directory, or None where it has no
    safetensors file, safetensors index or pytorch_model.bin."""
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    pickled = os.path.join(checkpoint, WEIGHTS_NAME)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(checkpoint, v) for k, v in json.load(f)["weight_map"].items()}
    if os.path.isfile(pickled):
        return {k: pickled for k in torch.load(pickled, map_location="meta", weights_only=True)}
    return None


@dataclass
class LoadReport:
    """What load_weights_in_place did: the model's tensors it could not find in the checkpoint,
    and the checkpoint's tensors no model tensor maps to."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    restored: int = 0


class _CheckpointReader:
    """Reads one checkpoint tensor at a time (safetensors lazily; a pytorch_model.bin once)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self._pickled: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, key: str) -> torch.Tensor:
        path = self.files[key]
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt", device="cpu") as f:
                return f.get_tensor(key)
        if path not in self._pickled:
            self._pickled[path] = torch.load(path, map_location="cpu", weights_only=True)
        return self._pickled[path][key]


def load_weights_in_place(model: PreTrainedModel, checkpoint: str) -> LoadReport:
    """Copy a ``save_pretrained`` checkpoint into ``model``'s own tensors, converting its layout.

    transformers 5 saves some tensors in another layout than the module holds them (OLMoE's
    batched ``mlp.experts.gate_up_proj`` as per-expert ``gate_proj``/``up_proj`` matrices,
    GraniteMoe's ``router.weight`` as ``router.layer.weight``) by reverting the model's weight
    conversion (``transformers.core_model_loading.revert_weight_conversion``) when saving. That
    conversion only moves elements, so reverting it on a tensor of element indices tells, for
    every checkpoint tensor, where each of its elements lives in the model's tensor. The
    elements are copied there in place: the parameters keep their storage (SonarAdamW's shared
    memory), no second model is built, and one tensor is read from the checkpoint at a time.
    """
    files = checkpoint_files(checkpoint)
    if files is None:
        raise FileNotFoundError(f"no model weights in {checkpoint}")
    reader = _CheckpointReader(files)
    report = LoadReport()
    used: set[str] = set()
    names: dict[int, list[str]] = {}  # tied weights: one tensor under several names
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    with torch.no_grad():
        for tid, tensor in tensors.items():
            found = next((p for p in (_placement(model, n, tensor, files) for n in names[tid]) if p), None)
            if found is None:
                report.missing.extend(names[tid])
                continue
            flat = tensor.detach().view(-1)
            for key, where in found.items():
                value = reader.get(key).to(device=flat.device, dtype=flat.dtype)
                if where is None:  # stored as the model holds it
                    tensor.detach().copy_(value)
                else:
                    flat[where.reshape(-1).to(flat.device)] = value.reshape(-1)
                used.add(key)
            report.restored += 1
    report.unexpected = sorted(set(files) - used)
    return report


def _placement(model: PreTrainedModel, name: str, tensor: torch.Tensor,
               files: dict[str, str]) -> dict[str, torch.Tensor | None] | None:
    """{checkpoint key: indices of its elements in ``tensor`` (None: the whole tensor, as is)}
    for the model tensor ``name``; None if the checkpoint does not hold it."""
    probe = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    reverted = revert_weight_conversion(model, {name: probe})
    if list(reverted) == [name] and reverted[name] is probe:  # not converted: stored as is
        return {name: None} if name in files else None
    if not any(k in files for k in reverted):
        return None
    dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
    index = torch.arange(tensor.numel(), dtype=dtype).view(tensor.shape)
    parts = revert_weight_conversion(model, {name: index})
    covered = torch.zeros(tensor.numel(), dtype=torch.int8)
    for key, where in parts.items():
        if key not in files or where.dtype != dtype:
            raise RuntimeError(f"{name}: its checkpoint layout ({sorted(parts)}) is not a rearrangement of its "
                               f"elements found in the checkpoint, so it cannot be loaded in place")
        covered.index_add_(0, where.reshape(-1), torch.ones(where.numel(), dtype=torch.int8))
    if not bool((covered == 1).all()):
        raise RuntimeError(f"{name}: its checkpoint tensors ({sorted(parts)}) do not cover each element once")
    return dict(parts)


def report_load(report: LoadReport, checkpoint: str) -> None:
    """Warn, as Trainer does, about model tensors the checkpoint lacked or tensors it had in excess."""
    if report.missing:
        log.warning("model tensors not in the checkpoint %s (kept as they were): %s", checkpoint, report.missing)
    if report.unexpected:
        log.warning("checkpoint tensors in %s that no model tensor takes: %s", checkpoint, report.unexpected)
    log.info("loaded %d model tensors in place from %s", report.restored, checkpoint)
