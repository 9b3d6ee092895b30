"""SonarAdamW: torch.optim.AdamW with the expert tensors updated by sonard during backward.

This module keeps the ``torch.optim.Optimizer`` bookkeeping: parameter groups, the dense
AdamW, the expert step counters in ``state``, state_dict, the gradient hooks and figures.
Everything about how expert tensors reach the server is an expert backend (``_backend.py``),
chosen once when the optimizer starts: shared memory for CPU tensors, CUDA IPC for CUDA ones.
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ._backend import DTYPES, BackendOptions, ExpertBackend, NoExperts
from ._connection import SonarError
from ._cuda_backend import CudaBackend
from ._detect import is_expert_param
from ._shm_backend import ShmBackend

log = logging.getLogger("sonar_moe")


def torch_scalars(group: dict[str, Any], step: float) -> dict[str, Any]:
    """One step's AdamW constants, computed in Python float64 exactly as
    torch.optim.adam._single_tensor_adam computes them."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    return {
        "decay": 1 - lr * wd,
        "apply_decay": wd != 0,
        "beta1_w": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "neg_step_size": -step_size,
        "bc2_sqrt": bias_correction2_sqrt,
        "eps": float(group["eps"]),
        "amsgrad": bool(group["amsgrad"]),
        "maximize": bool(group["maximize"]),
    }


def open_backend(named: list[tuple[str, nn.Parameter]], server: str | None, options: BackendOptions,
                 hyper: dict[str, Any], advance: Callable[[nn.Parameter], tuple[int, dict[str, Any]]]) -> ExpertBackend:
    """The expert backend of these tensors, chosen once: CUDA IPC when any expert tensor is on
    a GPU, shared memory for CPU tensors, none without expert tensors."""
    if not named:
        return NoExperts()
    cuda = any(p.device.type == "cuda" for _, p in named)
    return (CudaBackend if cuda else ShmBackend).open(server, named, options, hyper, advance)


def _check_options(grad_accumulation_steps: int, max_grad_norm: float | None, max_expert_grad_norm: float | None,
                   nonfinite: str, ring_layers: int) -> None:
    if grad_accumulation_steps < 1:
        raise ValueError(f"grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    if max_expert_grad_norm is not None:
        if not max_expert_grad_norm > 0:
            raise ValueError(f"max_expert_grad_norm must be positive or None, got {max_expert_grad_norm}")
        if grad_accumulation_steps > 1:
            raise ValueError("max_expert_grad_norm clips each expert tensor's gradient as it arrives, which with "
                             "grad_accumulation_steps > 1 would clip micro-batches, not their sum: not supported")
    if nonfinite not in ("propagate", "skip"):
        raise ValueError(f"nonfinite must be 'propagate' or 'skip', got {nonfinite!r}")
    if ring_layers < 1:
        raise ValueError(f"ring_layers must be >= 1, got {ring_layers}")


def _check_expert(name: str, p: torch.Tensor) -> None:
    if p.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"expert tensor {name} is on {p.device}: only CPU and CUDA tensors are supported")
    if p.device.type == "cuda" and not p.is_contiguous():
        raise ValueError(f"CUDA expert tensor {name} is not contiguous")
    if p.dtype not in DTYPES:
        raise TypeError(f"expert tensor {name} has dtype {p.dtype}: float32 and bfloat16 are supported")
    if not p.is_leaf:
        raise ValueError(f"expert tensor {name} is not a leaf tensor")


class SonarAdamW(torch.optim.Optimizer):
    """AdamW whose expert tensors are updated by sonard the moment their gradient is final.

    Bit-for-bit equal to ``torch.optim.AdamW`` over all parameters (with
    ``max_grad_norm=c``: to ``clip_grad_norm_(dense_params, c)`` then AdamW).
    See the README for usage and limits.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        expert_params: Callable[[str, torch.Tensor], bool] | None = None,
        server: str | None = None,
        grad_accumulation_steps: int = 1,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        max_expert_grad_norm: float | None = None,
        split_experts: bool = False,
        nonfinite: str = "propagate",
        timeout: float = 10.0,
        ring_layers: int = 1,
        namespace: str | None = None,
    ) -> None:
        named = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
        seen: set[int] = set()
        params: list[tuple[str, nn.Parameter]] = []
        for name, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((name, p))
        if not params:
            raise ValueError("SonarAdamW got no trainable parameters")
        _check_options(grad_accumulation_steps, max_grad_norm, max_expert_grad_norm, nonfinite, ring_layers)
        pred = expert_params or is_expert_param
        self._experts: list[tuple[str, nn.Parameter]] = []
        self._expert_names: dict[int, str] = {}
        dense: list[nn.Parameter] = []
        for name, p in params:
            if pred(name, p):
                _check_expert(name, p)
                self._experts.append((name, p))
                self._expert_names[id(p)] = name
            else:
                dense.append(p)
        # Dense parameters keep standard AdamW; its defaults are this optimizer's defaults.
        self._dense_params = dense
        self._dense = torch.optim.AdamW(
            dense or [nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        )
        super().__init__([p for _, p in params], dict(self._dense.defaults))
        self.max_grad_norm = max_grad_norm
        self.max_expert_grad_norm = max_expert_grad_norm
        # split_experts: one server tensor and one request per expert slice of a batched tensor.
        # Same updates, more requests: the per-expert baseline of the benchmarks.
        self.split_experts = split_experts
        # nonfinite="propagate": NaN/Inf gradients update as in torch (the parameter becomes NaN).
        # "skip": a tensor whose gradient is not finite is not updated (nor its step advanced);
        # the dense step is skipped when any dense gradient is not finite.
        self.nonfinite = nonfinite
        self.grad_accumulation_steps = grad_accumulation_steps
        # namespace: a label for this client (e.g. "rank3" when several ranks share one sonard),
        # sent in hello (servers ignore keys they do not know), shown in logs and stats().
        # Isolation itself needs no label: tensors and segments belong to the connection.
        self.namespace = namespace
        self.last_dense_grad_norm: torch.Tensor | None = None
        self._closed = False
        self._hooks: list[Any] = []
        self._skipped_nonfinite = 0
        self._hand_over_s = 0.0
        self._wait_s = 0.0
        options = BackendOptions(timeout=timeout, split_experts=split_experts,
                                 grad_accumulation_steps=grad_accumulation_steps,
                                 max_expert_grad_norm=max_expert_grad_norm, ring_layers=ring_layers, namespace=namespace)
        self._backend = open_backend(self._experts, server, options, self._hyper(), self._advance)
        for _, p in self._experts:
            self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _hyper(self) -> dict[str, Any]:
        """The hyper-parameters the server checks at registration."""
        g = self.param_groups[0]
        return {"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
                "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]),
                "amsgrad": bool(g["amsgrad"]), "maximize": bool(g["maximize"])}

    def _advance(self, p: nn.Parameter) -> tuple[int, dict[str, Any]]:
        """The expert tensor's next step: advance its step counter; that step's scalars."""
        step_t = self.state[p]["step"]
        step_t += 1
        step = step_t.item()
        return int(step), torch_scalars(self.param_groups[0], step)

    # ------------------------------------------------------------ public views
    def named_expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The expert tensors the server updates, with their names, in registration order."""
        return list(self._experts)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters stepped by the dense AdamW (everything that is not an expert tensor)."""
        return list(self._dense_params)

    @property
    def dense_optimizer(self) -> torch.optim.AdamW:
        """The ``torch.optim.AdamW`` that steps the dense parameters (its ``state`` is theirs)."""
        return self._dense

    @property
    def server_address(self) -> str | None:
        """The address of this optimizer's sonard (its private one, or ``server=``); None
        without expert tensors."""
        return self._backend.server_address

    @property
    def server_process(self) -> subprocess.Popen[bytes] | None:
        """The private sonard process this optimizer started; None for a shared server."""
        return self._backend.server_process

    @property
    def request_latencies(self) -> list[float]:
        """Seconds from sending each answered request to handling its reply, oldest first (a copy)."""
        return self._backend.request_latencies

    # --------------------------------------------------------------- backward
    def _on_grad(self, p: torch.Tensor) -> None:
        """post-accumulate-grad hook: hand the gradient over and free it."""
        if p.grad is None:
            return
        self._hand_over(p, p.grad, owned=True)  # no local reference: the backend frees it

    def remove_grad_hooks(self) -> None:
        """Stop taking expert gradients from the post-accumulate-grad hooks.

        For callers that produce the final gradient elsewhere (e.g. after a data-parallel
        all-reduce, see ``sonar_moe.distributed``) and pass it to :meth:`hand_over_grad`.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def hand_over_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply ``grad`` as this step's gradient of expert tensor ``param`` (one micro-batch).

        As the post-accumulate-grad hook does, but with a gradient the caller owns: it is
        copied into a slot of the ring and sent; ``grad`` and ``param.grad`` are left alone
        (the caller frees them). Exactly the update the hook would make for ``param.grad = grad``.
        """
        name = self._expert_names.get(id(param))
        if name is None:
            raise ValueError("hand_over_grad: not an expert parameter of this optimizer")
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            raise ValueError(f"hand_over_grad: gradient {tuple(grad.shape)} {grad.dtype} {grad.device} does not "
                             f"match {name} {tuple(param.shape)} {param.dtype} {param.device}")
        self._hand_over(param, grad, owned=False)

    def _hand_over(self, p: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
        """Hand one expert gradient to the backend. owned: grad is p.grad, freed there."""
        if self._closed:
            raise SonarError("SonarAdamW is closed")
        t = time.perf_counter()
        try:
            if self.nonfinite == "skip" and not bool(torch.isfinite(grad).all()):
                if owned:
                    p.grad = None
                self._skipped_nonfinite += 1
                log.warning("skipping the update of %s: its gradient is not finite", self._expert_names[id(p)])
                return
            self._backend.hand_over(p, grad, owned)  # type: ignore[arg-type]
        finally:
            self._hand_over_s += time.perf_counter() - t

    def _drain(self) -> None:
        """Wait for every expert update (sending what is pending, applying accumulated gradients)."""
        t = time.perf_counter()
        try:
            self._backend.drain()
        finally:
            self._wait_s += time.perf_counter() - t

    # ------------------------------------------------------------ optimizer
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Wait for the expert updates, clip the dense gradients, step dense AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise SonarError("SonarAdamW is closed")
        self._drain()
        if self._dense_params:
            dg = self._dense.param_groups[0]
            for k, v in self.param_groups[0].items():
                if k != "params":
                    dg[k] = v
            if self.nonfinite == "skip" and not all(
                    bool(torch.isfinite(p.grad).all()) for p in self._dense_params if p.grad is not None):
                self._skipped_nonfinite += 1
                log.warning("skipping the dense step: a dense gradient is not finite")
                return loss
            if self.max_grad_norm is not None:
                self.last_dense_grad_norm = torch.nn.utils.clip_grad_norm_(self._dense_params, self.max_grad_norm)
            self._dense.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's state_dict format, expert state fetched from the server."""
        self._drain()
        for p in self._dense_params:
            if p in self._dense.state:
                self.state[p] = self._dense.state[p]
        with self._backend.state_transfer(bool(self.param_groups[0]["amsgrad"])) as xfer:
            try:
                for _, p in self._experts:
                    st = self.state[p]
                    if st["step"].item() == 0:
                        continue
                    st.update(xfer.fetch(p))
                sd = super().state_dict()
            finally:
                for _, p in self._experts:  # the server keeps the state; sd keeps the copies
                    self.state[p] = {"step": self.state[p]["step"]}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of SonarAdamW or torch.optim.AdamW; expert state goes to the server."""
        self._drain()
        super().load_state_dict(state_dict)
        for p in self._dense_params:
            if p in self.state:
                self._dense.state[p] = self.state[p]
        with self._backend.state_transfer(bool(self.param_groups[0]["amsgrad"])) as xfer:
            for _, p in self._experts:
                st = self.state[p]
                step_t = st.get("step")
                step_t = torch.tensor(0.0) if step_t is None else step_t.detach().to(torch.float32).cpu().clone()
                xfer.store(p, int(step_t.item()), st)
                self.state[p] = {"step": step_t}

    # ------------------------------------------------------------ reporting
    def stats(self, server: bool = True) -> dict[str, Any]:
        """Client figures (peak expert-gradient bytes, requests, latencies, seconds spent handing
        gradients over and waiting for updates) and, with server=True, the server's counters."""
        lat = sorted(self._backend.request_latencies)
        out: dict[str, Any] = {
            **self._backend.stats(),
            "namespace": self.namespace,
            "expert_tensors": len(self._experts),
            "dense_tensors": len(self._dense_params),
            "skipped_nonfinite": self._skipped_nonfinite,
            "hand_over_s": self._hand_over_s,
            "wait_s": self._wait_s,
            "requests": len(lat),
            "latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else 0.0,
            "latency_ms_p99": 1e3 * lat[min(len(lat) - 1, len(lat) * 99 // 100)] if lat else 0.0,
            "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else 0.0,
        }
        if server and not self._closed:
            srv = self._backend.server_stats()
            if srv is not None:
                out["server"] = srv
        return out

    def reset_peak(self) -> None:
        """Start a new peak measurement of expert-gradient bytes."""
        self._backend.reset_peak()

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for outstanding updates, stop a private server (or leave a shared one).

        A private server that has died is not waited for: close() then only cleans up."""
        if self._closed:
            return
        self._closed = True
        try:
            self._backend.close()
        finally:
            for h in self._hooks:
                h.remove()

    def __enter__(self) -> SonarAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
