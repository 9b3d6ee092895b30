"""SonarAdamW: torch.optim.AdamW with the expert tensors updated by sonard during backward.

``SonarAdamW`` is a ``torch.optim.AdamW``: parameter groups, defaults, ``add_param_group``,
``state``, ``state_dict``/``load_state_dict`` (older dicts too), hooks and schedulers are
torch's own. What differs is where the expert tensors are updated: each one is handed to an
expert backend (``_backend.py``) the moment its gradient is final, and the server applies
AdamW to it there; ``step()`` then waits for those updates and steps the dense parameters
with torch's functional AdamW, exactly as ``torch.optim.AdamW.step`` does.

Where torch's semantics cannot hold for an update made during backward (a step decided only
after all gradients exist), the script fails loudly instead of training differently; the
README's "Limits" lists those cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import statistics
import subprocess
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any, overload

import torch
from torch import nn
from torch.optim.adam import adam

from ._backend import DTYPES, STATE_KEYS, BackendOptions, ExpertBackend, NoExperts
from ._clipping import MODES as EXPERT_CLIPPING_MODES
from ._clipping import ExpertClipper
from ._connection import RequestTrace, SonarError, SonarServerDied
from ._interrupts import HELD
from ._cuda_backend import CudaBackend
from ._dtensor import clip_grad_norm, is_dtensor, local, local_state, one_kind
from ._dtensor import check as check_dtensor
from ._fsdp1 import ADVICE as FSDP1_ADVICE
from ._fsdp1 import CLIPPING as FSDP1_CLIPPING
from ._fsdp1 import flat_part as fsdp1_flat_part
from ._fsdp1 import flattened as fsdp1_flattened
from ._fsdp1 import units as fsdp1_units
from ._requires import torch_release
from ._params import ExpertPredicate, expert_slices, group_names, is_expert, module_experts, torch_params
from ._shm_backend import ShmBackend
from ._zeroing import AppliedGrads, ModelOutputs

log = logging.getLogger("sonar_moe")

# Which live SonarAdamW updates each expert tensor (a newer one takes it over): id(tensor) ->
# (the tensor, the optimizer), both weakly (tensors compare elementwise, so not as dict keys).
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[SonarAdamW]]] = {}


def _owner(p: torch.Tensor) -> SonarAdamW | None:
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


_PLAIN = (float, int)  # hyper-parameters whose step scalars are made once a step for every tensor alike


def _value(x: float | torch.Tensor) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def torch_scalars(group: Mapping[str, Any], step: float, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One step's AdamW constants, computed exactly as torch.optim.adam._single_tensor_adam
    computes them: in Python float64 for float hyper-parameters, and with torch's own tensor
    arithmetic where lr or betas are tensors (beta1 first cast to the parameter's dtype, as
    torch does). The server rounds each to the parameter's compute type, as the torch op
    consuming it does."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    lr, beta1, beta2 = (x.reshape(()) if isinstance(x, torch.Tensor) else x for x in (lr, beta1, beta2))
    weight1 = 1 - (beta1.to(dtype) if isinstance(beta1, torch.Tensor) and dtype is not None else beta1)
    wd = group["weight_decay"]
    wd = wd.reshape(()) if isinstance(wd, torch.Tensor) else float(wd)  # a tensor: 1 - lr*wd in its arithmetic
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    return {
        "decay": _value(1 - lr * wd),
        "apply_decay": bool(wd != 0),
        "beta1_w": _value(weight1),
        "beta2": _value(beta2),
        "one_minus_beta2": _value(1 - beta2),
        "neg_step_size": _value(-step_size),
        "bc2_sqrt": _value(bias_correction2_sqrt),
        "eps": float(group["eps"]),
        "amsgrad": bool(group["amsgrad"]),
        "maximize": bool(group["maximize"]),
    }


def torch_foreach_cpu_scalars(group: Mapping[str, Any], step: float, dtype: torch.dtype) -> dict[str, Any]:
    """One step's constants as torch's foreach AdamW (``_multi_tensor_adam``) uses them on CPU:
    those of the single-tensor path, except that ``_foreach_mul_(tensors, scalar)`` on CPU casts
    its scalar to the tensors' dtype before multiplying (the other foreach ops keep it in
    float32), so for bfloat16 the weight decay factor and beta2 are rounded to bfloat16 (double
    -> float -> bfloat16, as c10 converts). For float32 nothing changes."""
    scalars = torch_scalars(group, step, dtype)
    if dtype == torch.bfloat16:
        for key in ("decay", "beta2"):
            scalars[key] = float(torch.tensor(scalars[key], dtype=torch.float32).to(dtype).item())
    return scalars


def dense_foreach(group: Mapping[str, Any], params: list[torch.Tensor], steps: list[torch.Tensor]) -> bool | None:
    """The ``foreach`` flag for torch's ``adam()`` over a group's dense parameters.

    torch's default (``foreach=None``) on CPU is the single-tensor path, one Python-level
    sequence of operators per tensor. Its foreach path runs the same operators on each tensor,
    looped in C++ (on CPU every ``_foreach_`` operator is that loop), with the same scalars in
    float32 (in bfloat16 and float16 ``_foreach_mul_`` rounds its scalar to the tensors' dtype:
    other bits), so for float32 tensors on CPU it gives the single-tensor path's bits with
    less overhead per tensor (GraniteMoe's 58 dense tensors: 1.35 against 1.83 ms a step,
    docs/results-history.md). Taken there only, with plain float hyper-parameters and neither
    fused, capturable nor differentiable, and float32 ``step`` tensors (a loaded state may hold
    int64 ones, which the single-tensor path takes and foreach refuses), and tensors of one kind
    (all plain, or DTensors of one mesh: a ``_foreach_`` operator refuses DTensors beside
    tensors, as transformers' tensor-parallel loading leaves them, sharded weights beside
    replicated norms); anything else keeps the group's own flag."""
    foreach = group["foreach"]
    if foreach is not None or group["fused"] or group["capturable"] or group["differentiable"] or not params:
        return foreach
    if any(isinstance(x, torch.Tensor) for x in (group["lr"], *group["betas"], group["weight_decay"], group["eps"])):
        return foreach
    if (all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params) and one_kind(params)
            and all(t.dtype == torch.float32 for t in steps)):
        return True
    return foreach


def fused_lanes(dtype: torch.dtype) -> int:
    """The vector width of this torch's fused CPU AdamW kernel for ``dtype``: the AVX2 kernel
    (also what AVX-512 machines run) has 8 float32 or 16 bfloat16 lanes and a scalar tail; the
    plain build (``ATEN_CPU_CAPABILITY=default``) has no lanes (docs/fused-adamw-cpu.md)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "DEFAULT":
        return 0
    if cap in ("AVX2", "AVX512"):
        return 8 if dtype == torch.float32 else 16
    raise NotImplementedError(f"fused=True for expert tensors on a {cap} CPU: only the AVX2, AVX-512 and "
                              "default builds of torch's fused kernel are reproduced")


def torch_fused_scalars(group: Mapping[str, Any], step: float, dtype: torch.dtype) -> dict[str, Any]:
    """One step's constants as torch's fused CPU AdamW computes them (in C double, each cast to
    float once by the kernel): bias_correction2's square root is ``sqrt``, not ``** 0.5``, and
    ``1 - lr*weight_decay`` is one fused multiply-add in the vector builds."""
    lr, (beta1, beta2) = _value(group["lr"]), (_value(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    lanes = fused_lanes(dtype)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    decay = float(Fraction(1) - Fraction(lr) * Fraction(wd)) if lanes else 1 - lr * wd
    return {
        "decay": decay,
        "apply_decay": bool(wd != 0),
        "beta1_w": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "neg_step_size": -(lr / bias_correction1),
        "bc2_sqrt": math.sqrt(bias_correction2),
        "eps": float(group["eps"]),
        "amsgrad": bool(group["amsgrad"]),
        "maximize": bool(group["maximize"]),
        "fused": True,
        "lanes": lanes,
    }


# torch's fused CUDA AdamW computes in float from torch 2.11 on; 2.8 to 2.10 evaluate the decay
# and the moving averages in double (read from their compiled kernels, docs/gpu.md "Fused");
# older releases are not reproduced.
FUSED_CUDA_FLOAT_TORCH = (2, 11)
FUSED_CUDA_DOUBLE_TORCH = (2, 8)


def fused_cuda_arithmetic(version: str | None = None) -> str | None:
    """Which fused CUDA AdamW this torch has: "float" (torch >= 2.11, sonard's sonar_fused
    kernels), "double" (2.8 to 2.10, the sonar_fused64 kernels), or None (older: not reproduced).
    A pre-release counts as its release."""
    v = torch_release(version)
    if v is None:
        return None
    if v >= FUSED_CUDA_FLOAT_TORCH:
        return "float"
    return "double" if v >= FUSED_CUDA_DOUBLE_TORCH else None


def torch_fused_cuda_scalars(group: Mapping[str, Any], step: float) -> dict[str, Any]:
    """One step's constants for torch's fused CUDA AdamW (``fused=True`` on a GPU). That kernel takes
    lr, the betas, weight_decay and eps as C doubles, casts each to float on the device and derives
    everything else there from the float step count (``1 - powf(beta, step)``); sonard's fused kernel
    does the same from ``lr``, ``beta1``, ``weight_decay``, ``beta2`` and ``eps`` sent here. The other
    scalars are the usual float64 ones (the server checks ``beta1_w`` and ``decay`` against them).
    With torch 2.8 to 2.10 ``fused_double`` asks for that kernel's partly double arithmetic."""
    sc = torch_scalars(group, step)
    lr, beta1 = _value(group["lr"]), _value(group["betas"][0])
    wd = float(group["weight_decay"])
    sc.update(decay=1 - lr * wd, beta1_w=1 - beta1, fused=True, lanes=0, lr=lr, beta1=beta1, weight_decay=wd)
    if fused_cuda_arithmetic() == "double":  # torch 2.8-2.10: that kernel's arithmetic
        sc["fused_double"] = True
    return sc


class NoExpertsWarning(UserWarning):
    """SonarAdamW found no expert tensor: it trains as plain torch.optim.AdamW, without sonard."""


def open_backend(named: list[tuple[str, nn.Parameter]], server: str | None, options: BackendOptions,
                 hyper_of: Callable[[nn.Parameter], Mapping[str, Any]], counter: Any,
                 slices: Mapping[int, int] | None = None) -> ExpertBackend:
    """The expert backend of these tensors, chosen once: CUDA IPC when any expert tensor is on
    a GPU, shared memory for CPU tensors, none without expert tensors."""
    if not named:
        return NoExperts()
    cuda = any(p.device.type == "cuda" for _, p in named)
    return (CudaBackend if cuda else ShmBackend).open(server, named, options, hyper_of, counter, slices)


def _check_options(grad_accumulation_steps: int, max_grad_norm: float | None, max_expert_grad_norm: float | None,
                   nonfinite: str, ring_layers: int | None, grad_scaler: Any,
                   expert_clipping: str | None = None) -> None:
    if expert_clipping is not None:
        if expert_clipping not in EXPERT_CLIPPING_MODES:
            raise ValueError(f"expert_clipping must be None or one of {', '.join(map(repr, EXPERT_CLIPPING_MODES))}, "
                             f"got {expert_clipping!r}")
        if max_grad_norm is None:
            raise ValueError("expert_clipping brings the expert gradients under max_grad_norm: set max_grad_norm")
        if max_expert_grad_norm is not None:
            raise ValueError("expert_clipping and max_expert_grad_norm both scale the expert gradients: choose one")
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
    if ring_layers is not None and (isinstance(ring_layers, bool) or not isinstance(ring_layers, int) or ring_layers < 0):
        raise ValueError(f"ring_layers must be None (chosen for the machine) or an int >= 0 (0: a hook that sends "
                         f"an update waits for it), got {ring_layers!r}")
    if grad_scaler is not None:
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        if grad_accumulation_steps > 1:
            raise ValueError("grad_scaler with grad_accumulation_steps > 1 is not supported: a micro-batch whose "
                             "gradient overflows could not be taken back from the accumulated sum")


def _check_expert(name: str, p: torch.Tensor) -> None:
    if p.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"expert tensor {name} is on {p.device}: only CPU and CUDA tensors are supported")
    if p.device.type == "cuda" and not p.is_contiguous():
        raise ValueError(f"CUDA expert tensor {name} is not contiguous")
    if p.dtype not in DTYPES:
        raise TypeError(f"expert tensor {name} has dtype {p.dtype}: float32 and bfloat16 are supported")
    if not p.is_leaf:
        raise ValueError(f"expert tensor {name} is not a leaf tensor")
    if not 1 <= p.dim() <= 8:
        raise ValueError(f"expert tensor {name} has {p.dim()} dimensions: expert tensors have 1 to 8 (an "
                         "expert_params predicate chose it; leave it dense)")
    check_dtensor(name, p)


def _check_unaliased(new: list[tuple[str, nn.Parameter]], others: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse expert tensors whose memory another tensor shares (tied parameters, a buffer or
    view of them, experts cut from one flat buffer): their memory moves into shared memory the
    server updates, which would untie them silently (torch keeps them tied)."""
    storages: dict[int, str] = {}
    mine: set[int] = set()
    for name, p in new:
        if id(p) in mine:  # the same tensor twice (torch warns of duplicate parameters)
            continue
        mine.add(id(p))
        ptr = _storage_ptr(p)
        if ptr:
            if ptr in storages:
                raise ValueError(f"expert tensors {storages[ptr]} and {name} share their memory: {_UNTIE}")
            storages[ptr] = name
    for oname, t in others:
        if id(t) in mine:
            continue
        ptr = _storage_ptr(t)
        if ptr and ptr in storages:
            raise ValueError(f"expert tensor {storages[ptr]} shares its memory with {oname}: {_UNTIE}")


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of t's storage; 0 where it has none to share (meta, a storage freed or
    resized to nothing, as FSDP2 leaves its unsharded parameters, a tensor subclass such as
    DTensor that has no storage of its own)."""
    if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter):
        return 0
    try:
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() else 0
    except RuntimeError:
        return 0


_UNTIE = ("SonarAdamW moves an expert tensor into shared memory that sonard updates, which would untie them "
          "silently. Give each its own memory (a clone), or leave the tensor dense with expert_params=")


def _loaded_step(value: Any) -> torch.Tensor:
    """The ``step`` of a loaded expert state as the 0-dim float32 tensor torch keeps: a whole
    number of steps float32 counts exactly (0 to 2**24), refused otherwise before anything changes."""
    t = torch.as_tensor(value).detach()
    if t.numel() != 1:
        raise ValueError(f"'step' has {t.numel()} elements, want 1")
    x = float(t.reshape(()).item())
    if not (math.isfinite(x) and x == int(x) and 0 <= x <= 2**24):
        raise ValueError(f"'step' is {x}: sonard counts whole steps from 0 to 2**24")
    return torch.tensor(x, dtype=torch.float32)


def _options_key(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """The options of a group an expert update uses, comparable (tensors as their values)."""
    return (_value(group["lr"]), _value(group["betas"][0]), _value(group["betas"][1]), float(group["eps"]),
            _value(group["weight_decay"]), bool(group["maximize"]))


def _grad_hook(opt: weakref.ref[SonarAdamW]) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of an expert tensor. It holds its optimizer weakly: a
    parameter must not keep alive an optimizer the script dropped without close() (a notebook
    cell run again kept one more sonard and session each time); once it is gone the gradient
    stays in ``.grad``, as without an optimizer. Never traced by torch.compile: a backward
    run inside a compiled function, or by compiled autograd, calls it as written (it talks to
    sonard; dynamo tracing it only found graph breaks, at every backward)."""
    @torch.compiler.disable
    def hook(p: torch.Tensor) -> None:
        o = opt()
        if o is not None:
            o._on_grad(p)
    return hook


def _output_hook(opt: weakref.ref[SonarAdamW]) -> Callable[[nn.Module, Any, Any], None]:
    """A forward hook of the modules that run the model (see _zeroing.ModelOutputs): it hooks
    the gradient of the forward's output tensors, which backward computes before any
    parameter's, so the zeroing check (check_new_step) runs there, with every dense gradient as
    the script left it (the expert hooks' check comes after autograd added to some). A forward
    with no output to hook (under torch.no_grad(): an evaluation) looks for the model again at
    the next one. Inside torch.compile's tracing it does nothing: the module torch.compile
    returns, found at the first forward, runs its hooks as written."""
    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        o = opt()
        if o is None or not o._zeroing_unchecked():
            return
        values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) \
            else (output,)
        hooked = False
        for t in values:
            # not a leaf (a parameter returned as it is): its hooks would stay for good
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(_output_grad_hook(opt))
                hooked = True
        if not hooked:
            o._outputs.arm()

    return forward_hook


def _runs_experts(opt: weakref.ref[SonarAdamW]) -> Callable[[nn.Module], bool | None]:
    """Whether a module's parameters include the optimizer's expert tensors (None: the
    optimizer is gone or closed); see _zeroing.ModelOutputs."""
    def runs(module: nn.Module) -> bool | None:
        o = opt()
        if o is None or o.closed:
            return None
        return any(id(p) in o._experts for p in module.parameters())
    return runs


def _output_grad_hook(opt: weakref.ref[SonarAdamW]) -> Callable[[torch.Tensor], None]:
    """The gradient hook of a forward's output (see _output_hook); run as written, as the
    expert hooks are, under compiled autograd too."""
    @torch.compiler.disable
    def hook(grad: torch.Tensor) -> None:
        o = opt()
        if o is not None and not o.closed:
            o.check_new_step("a new step's backward reached the model's output")
            o._seen_at_output = True
    return hook


class ExpertState(dict):
    """``opt.state[p]`` of an expert tensor: its ``step`` lives here, its moments on the
    server. It lists torch's keys; reading ``exp_avg`` (``exp_avg_sq``, ``max_exp_avg_sq``
    with amsgrad) fetches the moments from the server once. Until the tensor's next update the
    same tensors are returned, and what a script does to them (or to ``step``, or assigns in
    their place) is written back to the server before that update, so that it counts as it
    would in torch."""

    def __init__(self, fetch: Callable[[], dict[str, torch.Tensor]], step: torch.Tensor, amsgrad: bool) -> None:
        super().__init__(step=step)
        self._fetch = fetch
        self._moments = STATE_KEYS if amsgrad else STATE_KEYS[:2]

    def __missing__(self, key: str) -> torch.Tensor:
        if key in self._moments:
            fetched = self._fetch()
            for k in self._moments:
                dict.setdefault(self, k, fetched[k])
            return dict.__getitem__(self, key)
        raise KeyError(key)

    def unchanged(self, step: int) -> bool:
        """No moment read or set, and ``step`` still the float32 tensor of value ``step``: the
        server's state is this one (the check before every step, so it is kept cheap)."""
        raw = dict.get(self, "step")
        if type(raw) is not torch.Tensor or raw.dtype != torch.float32 or raw.item() != step:
            return False
        return dict.__len__(self) == 1 or not any(dict.__contains__(self, k) for k in self._moments)

    def held_moments(self) -> dict[str, torch.Tensor]:
        """The moments read (or assigned) since the server's were last written or updated."""
        return {k: dict.__getitem__(self, k) for k in self._moments if dict.__contains__(self, k)}

    def forget_moments(self) -> None:
        """The server's moments are the current ones again: the next read fetches them."""
        for k in self._moments:
            dict.pop(self, k, None)

    def _keys(self) -> list[str]:
        return [*dict.keys(self), *(k for k in self._moments if not dict.__contains__(self, k))]

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self._moments

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def keys(self) -> list[str]:  # type: ignore[override]
        return self._keys()

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return [(k, self[k]) for k in self._keys()]

    def values(self) -> list[Any]:  # type: ignore[override]
        return [self[k] for k in self._keys()]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


class SonarAdamW(torch.optim.AdamW):
    """AdamW whose expert tensors are updated by sonard the moment their gradient is final.

    Bit-for-bit equal to ``torch.optim.AdamW`` over all parameters (with
    ``max_grad_norm=c``: to ``clip_grad_norm_(dense_params, c)`` then AdamW).
    See the README for usage and limits.
    """

    # GradScaler calls step() itself and sets grad_scale/found_inf (see step()).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: nn.Module | Iterable[Any] | None = None,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        expert_params: ExpertPredicate | None = None,
        server: str | None = None,
        grad_accumulation_steps: int = 1,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        model: nn.Module | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        max_expert_grad_norm: float | None = None,
        expert_clipping: str | None = None,
        split_experts: bool = False,
        nonfinite: str = "propagate",
        timeout: float = 10.0,
        ring_layers: int | None = None,
        namespace: str | None = None,
        zero_copy: bool | None = None,
    ) -> None:
        _check_options(grad_accumulation_steps, max_grad_norm, max_expert_grad_norm, nonfinite, ring_layers,
                       grad_scaler, expert_clipping)
        if params is None:
            if model is None:
                raise TypeError("SonarAdamW needs the parameters to optimize (a module, parameters or groups)")
            params = model
        given, self._names = torch_params(params, model)
        self._in_module = module_experts(params, model)  # the module's layout, where a module is given
        self._module = params if isinstance(params, nn.Module) else model
        self._order = {pid: i for i, pid in enumerate(self._names)}  # the module's parameter order
        self._groups_key: tuple[int, ...] = ()
        # Every tensor the groups held when SonarAdamW looked at them (construction, add_param_group),
        # and the groups' lists then: a script that puts other tensors in them is caught (_check_swapped).
        self._known: set[int] = set()
        self._group_lists: tuple[int, ...] = ()
        self._group_by_param: dict[int, tuple[dict[str, Any], int]] = {}
        # A step's options and scalars (_hyper), made once for the expert tensors of a group that
        # share a step, a dtype and a device; cleared every step.
        self._scalars_made: dict[tuple[Any, ...], tuple[tuple[Any, ...], dict[str, Any]]] = {}
        # The group of the tensor whose gradient hook is running (_on_grad: looked up once a hook).
        self._hook_group: tuple[torch.Tensor, dict[str, Any]] | None = None
        self._pred = expert_params
        self._started = False
        self._closed = False
        self._superseded = False
        self._backend: ExpertBackend = NoExperts()
        self._experts: dict[int, tuple[str, nn.Parameter]] = {}
        self._hooks: dict[int, Any] = {}
        # the zeroing check at the start of each backward (see _output_hook)
        self._outputs = ModelOutputs(_output_hook(weakref.ref(self)), _runs_experts(weakref.ref(self)))
        self._registered: dict[int, dict[str, Any]] = {}  # amsgrad as registered (the server's state layout), device type
        self._external_grads = False  # remove_grad_hooks(): the caller hands gradients over
        # At the first expert gradient of each step, sonar_moe.distributed checks that no
        # DistributedDataParallel reduces these experts behind the hooks' back (they would see
        # the rank-local gradient).
        self._data_parallel_check_due = True
        # The DDP communication hook that feeds this optimizer, once one does (sonar_moe.distributed).
        self.ddp_hook: Any = None
        super().__init__(given, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, fused=fused)
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
        self.grad_scaler = grad_scaler
        # namespace: a label for this client (e.g. "rank3" when several ranks share one sonard),
        # sent in hello, shown in logs and stats(). Isolation needs no label.
        self.namespace = namespace
        self.last_dense_grad_norm: torch.Tensor | None = None
        # expert_clipping (off by default): global-norm clipping of the expert gradients with a factor
        # fixed before each step from the norms of earlier steps (see sonar_moe/_clipping.py)
        self.expert_clipping = expert_clipping
        self._clipper = ExpertClipper(expert_clipping, float(max_grad_norm)) \
            if expert_clipping is not None and max_grad_norm is not None else None
        self._skipped_nonfinite = 0
        self._hand_over_s = 0.0
        self._wait_s = 0.0
        self._grads_this_step: dict[int, int] = {}
        self._busy = 0  # depth of SonarAdamW's own update code running (hooks, step()): state_dict() refuses then
        self._advanced: set[int] = set()  # expert tensors stepped since the last step() (not refused)
        self._used: dict[int, tuple[Any, ...]] = {}  # the group options each one's latest update used
        self._overflowed: set[int] = set()  # experts whose scaled gradient overflowed this step
        # The step each expert tensor's server state is at, as this client last set or sent it:
        # a script that clears, deletes or changes opt.state[p] is caught by comparing with it.
        self._server_steps: dict[int, int] = {}
        self._handed_over_since_step = False  # the first hand-over after step() writes state back first
        self._applied_since_step = False  # the first expert update after step() checks the groups' options first
        # torch keeps a tensor's .grad until zero_grad(set_to_none=True); sonar frees an expert
        # tensor's in backward. The expert tensors torch would still hold a .grad for, and those
        # whose .grad zero_grad(set_to_none=False) would have made a zero tensor: torch steps
        # those with it when a backward gives them no gradient, and adds a new one to it.
        self._kept_grads: set[int] = set()
        # What the last step() applied (None after this optimizer's zero_grad(), which says how
        # it zeroes); whether the step's first expert gradient found it zeroed (check_new_step)
        self._applied: AppliedGrads | None = None
        self._zeroing_seen = False
        # How the script zeroed them, as that check saw it (AppliedGrads.zeroed_in_place; None:
        # not to be told there, see check_new_step)
        self._zeroed_in_place: bool | None = None
        self._seen_at_output = False  # this step's check ran at a model's output (_output_grad_hook)
        self._ended_steps = 0  # steps ended (step() or an abandoning zero_grad()): see ended_steps
        # The first step's expert gradients by the memory they are views of (None once looked at):
        # address -> [that memory's bytes, the expert gradients' bytes in it, their names]
        self._grad_buffers: dict[int, list[Any]] | None = {}
        self._zeroed_grads: set[int] = set()
        # set_step_boundary: whether the training loop says which backward completes a step
        # (None: the k-th), and the expert tensors whose step it completed since step()
        self._ends_step: bool | None = None
        self._completed: set[int] = set()
        self._ordered: set[int] = set()  # parameters whose opt.state entry is in torch's place (_order_state)
        self._ordered_in: Any = None  # the opt.state dict _ordered is about
        self._options = BackendOptions(timeout=timeout, split_experts=split_experts,
                                       grad_accumulation_steps=grad_accumulation_steps,
                                       max_expert_grad_norm=max_expert_grad_norm, ring_layers=ring_layers,
                                       namespace=namespace, zero_copy=zero_copy, clipper=self._clipper,
                                       module=self._module)
        self._server = server
        if max_grad_norm is not None and fsdp1_units(self._module):
            raise ValueError(FSDP1_CLIPPING)
        self._flattened = fsdp1_flattened(self._module)  # expert containers FSDP1 flattened: refused
        self._started = True
        self._adopt(self.param_groups)
        if self._module is not None and self._experts:
            self._outputs.hook(self._module)
        try:
            if self._clipper is not None and any(p.device.type != "cpu" for _, p in self._experts.values()):
                raise NotImplementedError("expert_clipping scales expert gradients on the server's CPU path only; "
                                          "these expert tensors are on CUDA")
            if self._flattened:
                more = f" and {len(self._flattened) - 1} more" if len(self._flattened) > 1 else ""
                warnings.warn(NoExpertsWarning(
                    f"SonarAdamW cannot update the expert tensors of {self._flattened[0]}{more}: it steps them "
                    f"as plain torch.optim.AdamW does, at step(), with no memory saved. {FSDP1_ADVICE}"),
                    stacklevel=2)
            elif not self._experts:
                warnings.warn(NoExpertsWarning(
                    "SonarAdamW found no expert tensors, so it is plain torch.optim.AdamW here: no sonard, no update "
                    "during backward, no memory saved. Name them with expert_params=lambda name, param: ... (see "
                    "docs/models.md for the layouts found on their own), or ignore this warning for a dense model"),
                    stacklevel=2)
            else:
                from .distributed import watch_for_ddp  # distributed imports this module
                watch_for_ddp(self, params if isinstance(params, nn.Module) else model)
        except BaseException:
            self.close()  # a set-up refused after the tensors went to the server leaves no session, hooks or server
            raise

    # -------------------------------------------------------- parameter groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group; new expert tensors are registered with the server."""
        super().add_param_group(param_group)
        if self._started:
            self._adopt(self.param_groups[-1:])

    def _adopt(self, groups: list[dict[str, Any]]) -> None:
        """Find the expert tensors of new parameter groups, take them over from an older
        SonarAdamW, hand them to the backend and hook their gradients."""
        new: list[tuple[str, nn.Parameter]] = []
        self._known.update(id(p) for g in groups for p in g["params"])
        self._group_lists = tuple(id(g["params"]) for g in self.param_groups)
        for g in groups:
            for name, p in zip(group_names(g, self._names), g["params"]):
                if id(p) in self._experts or not is_expert(name, p, self._pred, self._in_module):
                    continue
                label = name or self._label(p)
                _check_expert(label, p)
                new.append((label, p))
        if not new:
            return
        flat = [name for name, _ in new if fsdp1_flat_part(name, self._flattened)]
        if flat:
            raise ValueError(f"expert tensor {flat[0]} is part of a flat parameter of FSDP1: {FSDP1_ADVICE}")
        self._check_sharded(new)
        _check_unaliased(new, self._tensors_beside(new))
        for _, p in new:
            owner = _owner(p)
            if owner is not None and owner is not self:
                owner._surrender()
        for name, p in new:
            if not self._group_of(p)["fused"]:
                continue
            if p.device.type == "cpu":
                fused_lanes(p.dtype)  # refuses CPU builds whose fused kernel is not reproduced
            elif fused_cuda_arithmetic() is None:
                raise NotImplementedError(
                    f"fused=True for the CUDA expert tensor {name} with torch {torch.__version__}: sonard reproduces "
                    "the fused CUDA AdamW of torch >= 2.8 only; use a newer torch, or fused=False (foreach, torch's "
                    "CUDA default)")
        slices = {id(p): expert_slices(p, self._in_module) for _, p in new}
        if isinstance(self._backend, NoExperts):
            self._backend = open_backend(new, self._server, self._options, self._hyper_of, self, slices)
        else:
            self._backend.add(new, self._hyper_of, slices)
        for name, p in new:
            self._experts[id(p)] = (name, p)
            h = self._hyper_of(p)
            self._registered[id(p)] = {"amsgrad": h["amsgrad"], "maximize": h["maximize"], "device": p.device.type}
            _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
        self._hook_experts()

    def _check_sharded(self, new: list[tuple[str, nn.Parameter]]) -> None:
        """Refuse the options that would need the whole of a DTensor expert tensor (each rank's
        sonard session sees its local shard only)."""
        sharded = [name for name, p in new if is_dtensor(p)]
        if not sharded:
            return
        for option, value in (("max_expert_grad_norm", self.max_expert_grad_norm),
                              ("expert_clipping", self.expert_clipping)):
            if value is not None:
                raise NotImplementedError(f"{option} with DTensor (FSDP2) expert tensors ({sharded[0]}): the norm "
                                          "would be of this rank's shard only. Use max_grad_norm (the dense "
                                          "parameters)")
        if self.split_experts:
            raise NotImplementedError(f"split_experts with DTensor (FSDP2) expert tensors ({sharded[0]})")
        if self._module is None:
            raise ValueError(f"expert tensor {sharded[0]} is a DTensor (FSDP2): build SonarAdamW on the model "
                             "(SonarAdamW(model) or model=model), which it needs to move the local shards into "
                             "shared memory")

    def _tensors_beside(self, new: list[tuple[str, nn.Parameter]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every other tensor that could share memory with the new expert tensors: the
        parameters of every group and the module's parameters and buffers."""
        for g in self.param_groups:
            for name, p in zip(group_names(g, self._names), g["params"]):
                yield name or self._label(p), p
        if self._module is not None:
            yield from self._module.named_parameters(remove_duplicate=False)
            yield from self._module.named_buffers(remove_duplicate=False)

    def _hook_experts(self) -> None:
        """Hook the gradients of expert tensors that require them (a tensor frozen now is
        hooked at the first step() after it is unfrozen; until then step() applies its .grad)."""
        if self._external_grads:
            return
        for i, (_, p) in self._experts.items():
            if i not in self._hooks and p.requires_grad:
                self._hooks[i] = p.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self)))

    def _label(self, p: torch.Tensor) -> str:
        """A name for a parameter whose name is not known: its place in the groups."""
        for gi, g in enumerate(self.param_groups):
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}].params[{pi}]"
        return "parameter"

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        """p's parameter group. The map (each parameter's group and place in it) is rebuilt
        when the groups change (add_param_group, load_state_dict) or p is no longer where the
        map has it (a script moved it to another group), not on every gradient."""
        key = tuple(map(id, self.param_groups))
        found = self._group_by_param.get(id(p)) if key == self._groups_key else None
        if found is None or not (found[1] < len(found[0]["params"]) and found[0]["params"][found[1]] is p):
            self._groups_key = key
            self._group_by_param = {id(q): (g, i) for g in self.param_groups for i, q in enumerate(g["params"])}
            found = self._group_by_param.get(id(p))
            if found is None:
                raise KeyError("parameter not in any group")
        return found[0]

    def _grouped(self) -> list[tuple[int, tuple[str, nn.Parameter]]]:
        """The expert tensors in a parameter group now: a script may take one out of its group
        (or delete the group), after which torch leaves the tensor alone, its .grad unused."""
        ids = {id(q) for g in self.param_groups for q in g["params"]}
        return [(i, e) for i, e in self._experts.items() if i in ids]

    def _group_or_none(self, p: torch.Tensor) -> dict[str, Any] | None:
        try:
            return self._group_of(p)
        except KeyError:
            return None

    def _hyper_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The hyper-parameters the server checks at registration (those of p's group)."""
        g = self._group_of(p)
        return {"lr": _value(g["lr"]), "beta1": _value(g["betas"][0]), "beta2": _value(g["betas"][1]),
                "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]),
                "amsgrad": bool(g["amsgrad"]), "maximize": bool(g["maximize"])}

    # ------------------------------------------------------ expert step counts
    def advance(self, p: nn.Parameter) -> tuple[int, dict[str, Any]]:
        """The expert tensor's next step: count it (the state appears at the first one, as
        torch's does) and return that step's scalars (of p's group)."""
        if not self._applied_since_step:  # no expert update of this step yet: options checked first
            self._check_expert_groups()
            self._applied_since_step = True
        st = self.state.get(p)
        if self._handed_over_since_step and self._edited(p, st):
            # changed since the step's first hand-over (between micro-batches): written back
            # now, once the requests already sent are answered; the micro-batches accumulated
            # stay pending on the server, as torch's .grad stays through such an edit
            self._settle()
            self._write_back_state([p])
            st = self.state.get(p)
        if not isinstance(st, ExpertState):
            st = self.state[p] = ExpertState(self._fetcher(p), torch.tensor(0.0, dtype=torch.float32),
                                             self._registered[id(p)]["amsgrad"])
        if dict.__len__(st) > 1:
            st.forget_moments()  # the server's change with this step
        step_t = st["step"]
        # torch's `step_t += 1`, in place, to the same float32 (a whole number: the sum is exact
        # before fill_ rounds it as float32 addition would); a third of add_'s time
        step = step_t.item() + 1
        step_t.fill_(step)
        self._server_steps[id(p)] = int(step)
        self._advanced.add(id(p))
        hooked = self._hook_group
        g = hooked[1] if hooked is not None and hooked[0] is p else self._group_of(p)
        options, scalars = self._hyper(g, step, p)
        self._used[id(p)] = options
        return int(step), scalars

    def _hyper(self, g: dict[str, Any], step: float, p: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The options (_options_key) and the scalars (_scalars) of p's step `step` in group g.
        Where the group's hyper-parameters are plain numbers, they are made once a step for the
        tensors alike (a layer of per-expert tensors: hundreds of hooks), keyed by the group, its
        values (read from it each time, as torch reads them at each step), the step, the dtype and
        the device; any other kind (a tensor, which can change in place, a NumPy number) is
        worked out anew each time, in its own arithmetic."""
        lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        device = self._registered[id(p)]["device"]
        if not (type(lr) in _PLAIN and type(eps) in _PLAIN and type(wd) in _PLAIN and len(betas) == 2
                and type(betas[0]) in _PLAIN and type(betas[1]) in _PLAIN):
            options = _options_key(g)
            return options, self._scalars(g, step, p.dtype, device)
        key = (id(g), lr, betas[0], betas[1], eps, wd, bool(g["maximize"]), bool(g["amsgrad"]), bool(g["fused"]),
               bool(g["foreach"]), step, p.dtype, device)
        made = self._scalars_made.get(key)
        if made is None:
            if len(self._scalars_made) > 64:
                self._scalars_made.clear()
            options = _options_key(g)
            made = self._scalars_made[key] = (options, self._scalars(g, step, p.dtype, device))
        return made

    @staticmethod
    def _scalars(g: dict[str, Any], step: float, dtype: torch.dtype, device: str) -> dict[str, Any]:
        """The scalars of a step `step` of a tensor of that dtype and device in group g, as the
        torch path the group chooses computes them."""
        if g["fused"]:
            return torch_fused_cuda_scalars(g, step) if device == "cuda" else torch_fused_scalars(g, step, dtype)
        if g["foreach"] and device == "cpu":
            return torch_foreach_cpu_scalars(g, step, dtype)
        return torch_scalars(g, step, dtype)

    def retreat(self, p: nn.Parameter, step: int) -> None:
        """The server refused step `step` of p: the step was not taken."""
        st = self.state.get(p)
        if isinstance(st, ExpertState) and int(st["step"].item()) == step:
            st["step"] -= 1
            if step == 1:
                del self.state[p]
        if self._server_steps.get(id(p)) == step:
            self._server_steps[id(p)] = step - 1
        self._advanced.discard(id(p))

    def _fetcher(self, p: nn.Parameter) -> Callable[[], dict[str, torch.Tensor]]:
        ref = weakref.ref(self)

        def fetch() -> dict[str, torch.Tensor]:
            opt = ref()
            if opt is None or opt._closed:
                raise KeyError("the optimizer that holds this state is closed")
            return opt._fetch_moments(p)
        return fetch

    def _fetch_moments(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        self._settle()  # micro-batches still to come stay pending: torch's state is that before the step
        amsgrad = self._registered[id(p)]["amsgrad"]  # the server's state layout
        with self._backend.state_transfer(amsgrad) as xfer:
            got = xfer.fetch(p)
        return {k: v for k, v in got.items() if amsgrad or k != "max_exp_avg_sq"}

    # ------------------------------------------------------------ public views
    def named_expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The expert tensors the server updates, with their names, in registration order."""
        return list(self._experts.values())

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters stepped here with torch's AdamW (everything that is not an expert
        tensor), in the module's order where a module is known (``max_grad_norm`` clips them in
        this order, as Trainer clips ``model.parameters()``), else in the groups' order."""
        dense = [p for g in self.param_groups for p in g["params"] if id(p) not in self._experts]
        return sorted(dense, key=lambda p: self._order.get(id(p), len(self._order)))

    @property
    def ended_steps(self) -> int:
        """How many steps have ended: by ``step()``, or by a ``zero_grad()`` that dropped the
        backward passes no ``step()`` followed (torch drops their gradients). A gradient after
        this number changed belongs to a new step."""
        return self._ended_steps

    @property
    def closed(self) -> bool:
        """Whether close() was called (or a newer SonarAdamW took the expert tensors over)."""
        return self._closed

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
        """Seconds from sending each answered request to handling its reply, oldest first (a copy;
        the latest 65,536)."""
        return self._backend.request_latencies

    @property
    def request_traces(self) -> list[RequestTrace]:
        """Where each answered request's round trip went (``RequestTrace``, its ``segments()`` in
        microseconds), oldest first (a copy; the latest 65,536). Only with a server on this machine
        (``ipc://``, ``unix://``), whose clock the client shares."""
        return self._backend.request_traces

    # --------------------------------------------------------------- backward
    def _on_grad(self, p: torch.Tensor) -> None:
        """post-accumulate-grad hook: hand the gradient over and free it."""
        if p.grad is None:
            return
        g = self._group_or_none(p)
        if g is None:  # out of every group: torch leaves it alone
            return
        if self._data_parallel_check_due:
            self._data_parallel_check_due = False
            from .distributed import check_local_gradients  # distributed imports this module
            check_local_gradients(self)
        with HELD:  # as _updating(), written out: this runs once per expert gradient
            self._busy += 1
            try:
                if self._zeroing_unchecked():  # (the message is not built for every gradient of the step)
                    self.check_new_step(f"expert tensor {self._experts[id(p)][0]} received a new step's gradient")
                self._hook_group = (p, g)  # advance() reads it: nothing changes the groups in between
                self._take(p)
            finally:
                self._hook_group = None
                self._busy -= 1

    def _take(self, p: torch.Tensor) -> None:
        """Hand p.grad (this backward's final gradient of expert p) over, after the checks
        that keep a script from training differently than with torch."""
        self._check_usable()
        self._backend.check(p)  # type: ignore[arg-type]
        n = self._grads_this_step.get(id(p), 0) + 1
        if self._ends_step is not None and id(p) in self._completed:
            raise RuntimeError(
                f"expert tensor {self._experts[id(p)][0]} received a gradient after the backward that completed "
                "its step (set_step_boundary(True)) and before step(): SonarAdamW applied that step during the "
                "earlier backward, so this gradient would need a step of its own. Call step() first")
        if self._ends_step is None and n > self.grad_accumulation_steps:
            raise RuntimeError(
                f"expert tensor {self._experts[id(p)][0]} received gradient {n} before step(), but "
                f"grad_accumulation_steps={self.grad_accumulation_steps}: SonarAdamW applies AdamW to each expert "
                "tensor during backward, so backward() twice before step() would apply two steps. For gradient "
                "accumulation over k backward passes per step() pass grad_accumulation_steps=k (also with HF "
                "Trainer, and with Lightning's accumulate_grad_batches=k); with retain_graph=True call step() "
                "between the backward passes. An expert tensor used in several segments of reentrant activation "
                "checkpointing (use_reentrant=True) gets a gradient per segment: use use_reentrant=False. After an "
                "error or an interrupt part-way through a backward, zero_grad() ends that step")
        self._note_grad(p, n)
        assert p.grad is not None
        grad = local(p.grad)  # a DTensor's: the local shard's
        if self._grad_buffers is not None:
            self._note_grad_buffer(self._grad_buffers, p, grad)
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = torch.tensor(self.grad_scaler.get_scale(), dtype=torch.float64)
            if self._fused_unscales(self._group_of(p)):  # torch's fused kernel divides by the scale
                grad.div_(scale.float().to(grad.device))
            else:  # as GradScaler.unscale_ does: multiply by the float32 reciprocal of the scale
                grad.mul_(scale.reciprocal().float().to(grad.device))
            if not bool(torch.isfinite(grad).all()):
                # Not applied; the gradient stays in p.grad until step(), where GradScaler sees the overflow.
                self._overflowed.add(id(p))
                log.warning("skipping the update of %s: its unscaled gradient is not finite", self._experts[id(p)][0])
                return
        self._hand_over(p, grad, owned=True)  # no local reference kept: the backend frees it
        del grad
        if self._ends_step:
            self._completed.add(id(p))

    def _note_grad(self, p: torch.Tensor, n: int) -> None:
        """p's n-th gradient of this step is being handed over: step() then knows which expert
        tensors had none this step, and torch would now keep a .grad for p."""
        self._grads_this_step[id(p)] = n
        self._kept_grads.add(id(p))

    def _note_grad_buffer(self, buffers: dict[int, list[Any]], p: torch.Tensor, grad: torch.Tensor) -> None:
        """At the first step: the memory each expert gradient is a view of (see _check_grad_buffers)."""
        st = grad.untyped_storage()
        entry = buffers.setdefault(st.data_ptr(), [st.nbytes(), 0, []])
        entry[1] += grad.numel() * grad.element_size()
        entry[2].append(self._experts[id(p)][0])

    def _check_grad_buffers(self) -> None:
        """After the first step: warn where freeing expert gradients during backward frees no
        memory, because they are views of a buffer that other (dense) gradients keep until
        zero_grad(): FSDP2 reduce-scatters a group's gradients into one buffer, so experts
        sharded together with a layer's dense parameters save nothing (measured in
        docs/distributed.md, section 4)."""
        buffers, self._grad_buffers = self._grad_buffers or {}, None
        for whole, mine, names in buffers.values():
            if whole > mine + 1024 * len(names):  # more than the experts' gradients (and alignment)
                msg = (f"the gradients of expert tensors {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} are "
                       f"views of a {whole}-byte buffer that other gradients share (the experts' take {mine} bytes), so "
                       "freeing them during backward frees no memory until the others go at zero_grad(). FSDP2 "
                       "reduces a group's gradients into one buffer: give the experts a group of their own, "
                       "fully_shard(layer's experts module) before fully_shard(layer)")
                config = getattr(self._module, "config", None)
                if getattr(config, "distributed_config", None) is not None:  # sharded by transformers' loading
                    head = (names[0].split(".experts.")[0] + ".experts" if ".experts." in names[0]
                            else names[0].rsplit(".", 1)[0])
                    key = re.sub(r"\.\d+(?=\.|$)", ".*", head)
                    msg += (f"; transformers shards the model it loads with DistributedConfig(fsdp_size=...): add "
                            f"fsdp_plan={{{key!r}: 'free_full_weight'}} to it")
                log.warning("%s", msg)
                warnings.warn(msg, stacklevel=4)
                return

    def remove_grad_hooks(self) -> None:
        """Stop taking expert gradients from the post-accumulate-grad hooks.

        For callers that produce the final gradient elsewhere (e.g. after a data-parallel
        all-reduce, see ``sonar_moe.distributed``) and pass it to :meth:`hand_over_grad`.
        """
        self._external_grads = True
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()

    def reclaim_moved_experts(self) -> list[str]:
        """Put expert tensors whose memory was replaced by an equal CPU copy back into the shared
        memory the server updates, keeping their values; returns their names.

        accelerate's ``prepare`` (Trainer's too) calls ``model.to(torch.device("cpu", 0))`` after
        the optimizer exists on multi-process CPU runs, and torch copies CPU tensors for that
        device. ``sonar_moe.distributed`` calls this before DDP's forward and at the first expert
        gradient of a distributed step; elsewhere a moved expert tensor stays an error."""
        self._check_usable()
        return [name for name, p in self._experts.values() if self._backend.reclaim(p)]

    def set_step_boundary(self, ends_step: bool | None) -> None:
        """For a training loop that decides at each backward whether it completes the optimizer
        step (transformers' Trainer, through ``accelerator.sync_gradients``, which SonarTrainer
        passes on before each backward): True, the expert gradients of the coming backward
        complete their step and are applied during it, with those accumulated since ``step()``;
        False, they are accumulated for a later backward (or ``step()``, which applies what is
        left); None (the default), the ``grad_accumulation_steps``-th backward since ``step()``
        completes it. So a step of more or fewer micro-batches than ``grad_accumulation_steps``
        (Trainer carries a stream's last micro-batch into the next epoch's first step) is
        summed as torch sums it into ``.grad``. ``False`` (accumulation) is refused where
        ``grad_accumulation_steps > 1`` would be: with ``max_expert_grad_norm`` or ``grad_scaler``."""
        if ends_step is False and self.max_expert_grad_norm is not None:
            raise ValueError("set_step_boundary(False) accumulates micro-batches, and max_expert_grad_norm would clip "
                             "each of them, not their sum: not supported (as grad_accumulation_steps > 1)")
        if ends_step is False and self.grad_scaler is not None:
            raise ValueError("set_step_boundary(False) accumulates micro-batches, and with grad_scaler a micro-batch "
                             "whose gradient overflows could not be taken back from the sum: not supported (as "
                             "grad_accumulation_steps > 1)")
        self._ends_step = ends_step
        self._backend.set_step_boundary(ends_step)

    @property
    def step_boundary(self) -> bool | None:
        """What ``set_step_boundary`` set last (None: micro-batches are counted)."""
        return self._ends_step

    def accumulate_before_hand_over(self) -> None:
        """Gradients now arrive already summed over a step's micro-batches (DDP accumulates them
        in ``.grad`` under ``no_sync()`` and all-reduces once): each hand-over is applied at once,
        whatever ``grad_accumulation_steps`` was. Called by ``sonar_moe.distributed`` when it
        takes the DDP path, before any gradient of the step was handed over."""
        self._backend.set_grad_accumulation_steps(1)
        self._options = dataclasses.replace(self._options, grad_accumulation_steps=1)

    def hand_over_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply ``grad`` as this step's gradient of expert tensor ``param`` (one micro-batch).

        As the post-accumulate-grad hook does, but with a gradient the caller owns: it is
        copied and sent; ``grad`` and ``param.grad`` are left alone (the caller frees them).
        Exactly the update the hook would make for ``param.grad = grad``.
        """
        entry = self._experts.get(id(param))
        if entry is None:
            raise ValueError("hand_over_grad: not an expert parameter of this optimizer")
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            raise ValueError(f"hand_over_grad: gradient {tuple(grad.shape)} {grad.dtype} {grad.device} does not "
                             f"match {entry[0]} {tuple(param.shape)} {param.dtype} {param.device}")
        self._check_usable()
        self._backend.check(param)  # type: ignore[arg-type]
        if self._zeroing_unchecked():
            self.check_new_step(f"expert tensor {entry[0]} received a new step's gradient")
        with self._updating():
            self._note_grad(param, self._grads_this_step.get(id(param), 0) + 1)
            self._hand_over(param, grad, owned=False)

    def check_new_step(self, what: str, tells_zeroing: bool = True) -> None:
        """At a step's first expert gradient (``what`` says where it came): refuse it, before
        anything changes, where the last step()'s gradients were not zeroed (see _zeroing): torch
        would add this backward's gradients to the ones it keeps, SonarAdamW consumed the expert
        ones during the last backward. Once a step: a no-op until the next step().
        ``sonar_moe.distributed`` calls it before DDP all-reduces the step's first bucket.

        It also notes how they were zeroed (in place or to None, which step() follows), unless
        ``tells_zeroing`` is False: where the dense ``.grad`` may already hold a tensor that
        was theirs before zeroing (DDP with ``gradient_as_bucket_view=True`` sets each one to the
        same view of its bucket again once its gradient is in)."""
        if not self._zeroing_unchecked():
            return
        assert self._applied is not None
        held = self._applied.still_held()
        if held is not None:
            raise RuntimeError(
                f"{what}, but the gradients the last step() applied were not zeroed "
                f"({self._name_of(held)} still holds its .grad): torch would add this backward's gradients to them "
                "and apply the sums, while SonarAdamW applied the expert gradients during the last backward and no "
                "longer has them. Call opt.zero_grad() (or model.zero_grad()) after each step(); to sum k backward "
                "passes into one step pass grad_accumulation_steps=k. Nothing of this backward was applied")
        self._zeroed_in_place = self._applied.zeroed_in_place() if tells_zeroing else None
        self._zeroing_seen = True
        self._outputs.disarm()

    def _zeroing_unchecked(self) -> bool:
        """Whether check_new_step still has something to look at this step."""
        return self._applied is not None and not self._zeroing_seen

    def _name_of(self, p: torch.Tensor) -> str:
        return self._names.get(id(p)) or self._label(p)

    def _hand_over(self, p: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
        """Hand one expert gradient to the backend. owned: grad is p.grad, freed there."""
        if not self._handed_over_since_step:
            self._forget_deleted_state()
            self._write_back_state()  # nothing is in flight before the first hand-over of a step
            self._handed_over_since_step = True
        t = time.perf_counter()
        try:
            if self.nonfinite == "skip" and not bool(torch.isfinite(grad).all()):
                if owned:
                    p.grad = None
                self._skipped_nonfinite += 1
                log.warning("skipping the update of %s: its gradient is not finite", self._experts[id(p)][0])
                return
            self._backend.hand_over(p, grad, owned)  # type: ignore[arg-type]
        finally:
            self._hand_over_s += time.perf_counter() - t

    def _drain(self) -> None:
        """Wait for every expert update (sending what is pending, applying accumulated gradients)."""
        self._timed_wait(self._backend.drain)

    def _settle(self) -> None:
        """Wait for every expert request sent, applying nothing that waits for more micro-batches."""
        self._timed_wait(self._backend.settle)

    def _timed_wait(self, wait: Callable[[], None]) -> None:
        """Run a wait of the backend, counted in stats()' wait seconds."""
        t = time.perf_counter()
        try:
            wait()
        finally:
            self._wait_s += time.perf_counter() - t

    def _check_usable(self) -> None:
        if self._superseded:
            raise RuntimeError("this SonarAdamW's expert tensors were taken over by another SonarAdamW built on the "
                               "same parameters: step the new one (this one no longer updates them)")
        if self._closed:
            raise SonarError("SonarAdamW is closed")

    def _surrender(self) -> None:
        """A newer SonarAdamW takes over this one's expert tensors: stop updating them."""
        if self._closed:
            return
        log.warning("another SonarAdamW was built on the expert tensors of this one: it takes them over")
        self.close()
        self._superseded = True

    # ------------------------------------------------------ what torch would keep
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad. With ``set_to_none=False`` torch keeps a zero ``.grad`` for every
        tensor that had one and steps it even when the next backward gives it no gradient; the
        expert tensors whose ``.grad`` sonar freed are stepped so at ``step()``. (A new gradient
        is added to torch's zero: 0 + g, which is g but for -0.0, and AdamW's result is the same
        for -0.0 and +0.0: lerp's fma and the squares turn both into the same moments.)
        Called after backward passes that no ``step()`` followed, it abandons their step
        (``_abandon_step``)."""
        if not self._closed and (self._grads_this_step or self._backend.pending()):
            # (pending without gradients this step: a step() that raised before applying them)
            with HELD:
                self._abandon_step()
        super().zero_grad(set_to_none)
        self._applied = None  # how this zeroes is known: _kept_grads and _zeroed_grads below
        self._outputs.disarm()
        if set_to_none:
            self._kept_grads.clear()
            self._zeroed_grads.clear()
        else:
            self._zeroed_grads = {i for i in self._kept_grads if self._experts[i][1].grad is None}

    @contextlib.contextmanager
    def _updating(self) -> Iterator[None]:
        """SonarAdamW's own update code (a hook's hand-over, step()): a Ctrl-C meanwhile comes
        when it is whole (see _interrupts), and state_dict() refuses to run inside it."""
        with HELD:
            self._busy += 1
            try:
                yield
            finally:
                self._busy -= 1

    def _end_step(self) -> None:
        """Forget the step's bookkeeping: the next gradient starts a new step."""
        if self._grad_buffers:
            self._check_grad_buffers()
        for i in self._overflowed:
            self._experts[i][1].grad = None
        self._overflowed.clear()
        self._grads_this_step.clear()
        self._advanced.clear()
        self._zeroed_grads.clear()
        self._completed.clear()
        self._scalars_made.clear()
        self._handed_over_since_step = False
        self._applied_since_step = False
        self._data_parallel_check_due = True
        self._ended_steps += 1
        if not self._closed:
            self._hook_experts()

    def _warn_late_changes(self) -> None:
        """Options of a group changed after its expert tensors were updated this step (between
        the last backward and step(), e.g. an lr set in Trainer's on_pre_optimizer_step): torch
        uses them at this step, the updates already made did not; they count from the next."""
        late = []
        for g in self.param_groups:
            options = None
            for q in g["params"]:
                if id(q) in self._advanced:
                    options = _options_key(g) if options is None else options
                    if self._used.get(id(q)) != options:
                        late.append(self._experts[id(q)][0])
        if late:
            msg = (f"the options (lr, betas, eps, weight_decay or maximize) of {len(late)} expert tensors' groups "
                   f"changed after this step's update of them during backward ({', '.join(late[:3])}"
                   f"{', ...' if len(late) > 3 else ''}): torch would use the new values at this step, SonarAdamW "
                   "uses them from the next one. Change them after step() (where schedulers run)")
            log.warning("%s", msg)
            warnings.warn(msg, stacklevel=4)

    def _abandon_step(self) -> None:
        """zero_grad() after backward passes that no step() followed (an error caught by the
        script, a skipped batch, an interrupt): torch drops their gradients and applies nothing.
        The micro-batches summed on the server are dropped as well; the expert tensors already
        updated during those backward passes (SonarAdamW updates during backward) cannot be
        taken back, which is warned."""
        try:
            self._settle()
        except SonarServerDied:
            raise
        except SonarError as e:  # updates refused or lost (an interrupted send): not made, nothing to undo
            log.warning("abandoning the step: %s", e)
        self._backend.abandon()
        updated = [name for i, (name, _) in self._experts.items() if i in self._advanced]
        self._end_step()
        if updated:
            msg = (f"zero_grad() after a backward that no step() followed: the updates of {len(updated)} expert "
                   f"tensors made during it stay applied ({', '.join(updated[:3])}{', ...' if len(updated) > 3 else ''}; "
                   "SonarAdamW updates each expert tensor during backward, where torch would apply nothing)")
            log.warning("%s", msg)
            warnings.warn(msg, stacklevel=3)

    def _step_zeroed_grads(self) -> None:
        """The expert tensors whose ``.grad`` torch would hold as zeros (zero_grad(set_to_none=False))
        and that got no gradient this step: torch steps them with that zero gradient."""
        for i, (_, p) in self._grouped():
            if i in self._zeroed_grads and i not in self._grads_this_step and i not in self._overflowed:
                self._backend.check(p)
                self._grads_this_step[i] = 1
                self._hand_over(p, torch.zeros_like(p), owned=False)

    def _check_expert_groups(self) -> None:
        """Refuse, before any expert update of the step, options of the expert tensors' groups
        that sonard does not reproduce: ``decoupled_weight_decay=False`` turns torch's update into
        Adam's with L2 weight decay (torch.optim.Adam's), a script may set it in a group;
        ``differentiable`` and ``capturable`` (not offered, but a loaded state_dict's groups may
        carry them) are torch's other arithmetic."""
        for group in self.param_groups:
            mine = [self._experts[id(q)] for q in group["params"] if id(q) in self._experts]
            if not mine:
                continue
            amsgrad = bool(group["amsgrad"])
            for name, p in mine:
                if amsgrad != self._registered[id(p)]["amsgrad"]:
                    raise ValueError(f"expert tensor {name} is in a parameter group with amsgrad={amsgrad}, but "
                                     f"sonard holds its state as registered, with amsgrad="
                                     f"{self._registered[id(p)]['amsgrad']}: set it back, or build a new SonarAdamW "
                                     "with this amsgrad and load the old one's state_dict() (maximize may change "
                                     "freely)")
            name = mine[0][0]
            if not group.get("decoupled_weight_decay", True):
                raise ValueError(f"expert tensor {name} is in a parameter group with decoupled_weight_decay=False "
                                 "(Adam with L2 weight decay): sonard reproduces AdamW's decoupled weight decay only")
            for flag in ("differentiable", "capturable"):  # e.g. from a loaded state_dict's groups
                if group.get(flag):
                    raise ValueError(f"expert tensor {name} is in a parameter group with {flag}=True: torch's "
                                     f"{flag} arithmetic is not reproduced by sonard; set the group's {flag} to False")

    def _state_edited(self, p: nn.Parameter) -> bool:
        """Whether p's ``opt.state`` differs from what the server holds (see _write_back_state)."""
        return self._edited(p, self.state.get(p))

    def _edited(self, p: nn.Parameter, st: Any) -> bool:
        """_state_edited, given p's ``opt.state`` entry."""
        known = self._server_steps.get(id(p), 0)
        if isinstance(st, ExpertState):
            return not st.unchanged(known)
        return bool(st) or known > 0

    def _write_back_state(self, only: list[nn.Parameter] | None = None) -> None:
        """Give the server what the script did to the expert tensors' ``opt.state`` since their
        last update, as torch would use it at the next one: moments read and changed, or
        assigned; a changed ``step``; a plain dict set in the ExpertState's place; the state
        deleted or cleared (torch starts such a tensor afresh). Everything is checked before the
        server is told anything. Called where nothing is in flight."""
        work: dict[bool, list[tuple[nn.Parameter, int, dict[str, torch.Tensor] | None]]] = {}
        experts = self._grouped() if only is None else [(id(p), self._experts[id(p)]) for p in only]
        for _, (name, p) in experts:
            if not self._state_edited(p):
                continue
            st = self.state.get(p)
            if not st:  # cleared or deleted while the server holds a state: torch starts afresh
                work.setdefault(self._registered[id(p)]["amsgrad"], []).append((p, 0, None))
                continue
            if isinstance(st, ExpertState):
                held = st.held_moments()
            else:  # a dict set by the script: torch would use it as it is
                self._check_loaded(name, p, st)
                held = {k: v for k, v in st.items() if k in STATE_KEYS and isinstance(v, torch.Tensor)}
            step = self._state_step(name, st)
            for k, v in held.items():
                if v.shape != p.shape:
                    raise ValueError(f"opt.state of expert tensor {name}: {k} has shape {tuple(v.shape)}, want "
                                     f"{tuple(p.shape)}")
            work.setdefault(self._registered[id(p)]["amsgrad"], []).append((p, step, held))
        for amsgrad, items in work.items():
            with self._backend.state_transfer(amsgrad) as xfer:
                # the moments not read or set as the server has them (None: zeros)
                moments = set(STATE_KEYS[:3 if amsgrad else 2])
                partial = [p for p, _, kept in items if kept is not None and not moments <= kept.keys()]
                fetched = dict(zip(map(id, partial), xfer.fetch_all(partial)))
                steps = {id(p): step for p, step, _ in items}

                def stored(p: nn.Parameter, amsgrad: bool = amsgrad) -> None:
                    st = self.state.get(p)
                    self._server_steps[id(p)] = steps[id(p)]
                    if isinstance(st, ExpertState):
                        st.forget_moments()
                    elif st:
                        self.state[p] = ExpertState(self._fetcher(p), torch.tensor(float(steps[id(p)])), amsgrad)
                    else:
                        self.state.pop(p, None)
                xfer.store_all([(p, step, {} if kept is None else {**fetched.get(id(p), {}), **kept})
                                for p, step, kept in items], stored)
        if work:
            log.info("wrote opt.state changed by the script back to the server for %d expert tensor(s)",
                     sum(len(v) for v in work.values()))

    @staticmethod
    def _state_step(name: str, st: dict[str, Any]) -> int:
        """The state's step as the server keeps it: a whole number >= 0 (a float32 tensor, as torch's)."""
        raw = st.get("step")
        value = float(torch.as_tensor(raw).item()) if raw is not None else float("nan")
        if not (value >= 0 and value == int(value)):
            raise ValueError(f"opt.state of expert tensor {name}: step {raw!r} is not a whole number >= 0")
        if not (isinstance(raw, torch.Tensor) and raw.dtype == torch.float32 and raw.dim() == 0):
            st["step"] = torch.tensor(value, dtype=torch.float32)  # advance() counts it in place
        return int(value)

    # ------------------------------------------------------------ optimizer
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply hand-set expert gradients, wait for the expert updates, clip the dense
        gradients and step them with torch's AdamW."""
        return self._step_as_written(closure)

    # The expert updates go through sonard: torch.compile runs this as written. The disabled
    # function is not step() itself: torch 2.8, given torch.compile(opt.step), found the function
    # under a disabled method through the bound method's attributes and called it without self
    # ("step() missing 1 required positional argument: 'self'"); 2.15 does not.
    @torch.compiler.disable
    def _step_as_written(self, closure: Callable[[], float] | None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # SIGINT held from before torch.no_grad() is entered until after it is left: a Ctrl-C
        # inside its __enter__, after grad mode went off, would leave it off for good (its
        # __exit__ never runs), and the script's next forward would build no graph
        with HELD:
            self._step_held()
        return loss

    @torch.no_grad()
    def _step_held(self) -> None:
        self._check_usable()
        self._check_swapped()
        self._check_stepped_again()
        self._forget_deleted_state()
        # Set by GradScaler.step around this call (this class supports AMP scaling itself): the
        # scale the dense gradients still carry (None: already unscaled), whether any overflowed.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        with self._updating():
            try:
                if found_inf is not None and self.grad_scaler is None and self._experts:
                    raise RuntimeError(
                        "SonarAdamW was stepped by a GradScaler it was not given: its expert tensors were updated "
                        "during backward with still-scaled gradients. Pass grad_scaler=scaler to SonarAdamW")
                # Gradients set by hand, or produced outside the hooks: under DDP (external
                # gradients) those of a backward DDP did not all-reduce (no_sync, then step()), or
                # of a tensor DDP does not reduce; torch steps with them, so does this.
                for i, (_, p) in self._grouped():
                    if p.grad is not None and i not in self._overflowed:
                        self._take(p)
                self._follow_zeroing()
                if self._zeroed_grads and not (found_inf is not None and bool(found_inf.item())):
                    self._step_zeroed_grads()
                self._drain()
                self._warn_late_changes()
                dense = self.dense_parameters()  # (sorted once a step: 24-62 us for 147-226 tensors)
                self._dense_step(dense, grad_scale, found_inf)
                self._order_state()
                self._applied = AppliedGrads(self._zeroing_witnesses(dense), bool(self._advanced))
                self._zeroing_seen = False
                self._zeroed_in_place = None
                if self._experts and not self._seen_at_output:
                    # where the hooks did not see this backward start (the first step, no
                    # module, or a wrapper: torch.compile's), look for the model at the next
                    # forward (see _zeroing.ModelOutputs)
                    self._outputs.arm()
                self._seen_at_output = False
            finally:
                self._end_step()

    def _check_stepped_again(self) -> None:
        """step() with no backward and no zero_grad() since the last one: torch would apply the
        gradients it keeps again, the expert ones included, which SonarAdamW no longer has."""
        if (not self._zeroing_unchecked() or self._handed_over_since_step or self._grads_this_step
                or any(p.grad is not None for _, p in self._experts.values())):
            return
        assert self._applied is not None
        held = self._applied.still_held()
        if held is not None:
            raise RuntimeError(
                f"step() called again with no backward and no zero_grad() since the last step() "
                f"({self._name_of(held)} still holds the .grad it applied): torch would apply the gradients it keeps "
                "once more, the expert tensors' too, which SonarAdamW applied during the backward and no longer "
                "has. Nothing was stepped. Call zero_grad() and backward() between steps")

    def _follow_zeroing(self) -> None:
        """This optimizer's zero_grad() was not called since the last step(): the script zeroed
        with model.zero_grad() (Trainer does) or by hand, which the dense gradients tell (see
        _zeroing). Zeroed in place (set_to_none=False): torch keeps a zero .grad for every expert
        tensor that had one and steps those the backward gave none, as after
        opt.zero_grad(set_to_none=False). Set to None: torch holds only this step's."""
        if self._applied is None:
            return
        # as the step's first look saw it (before backward put gradients back); where nothing
        # looked (no expert gradient this step), now
        in_place = self._zeroed_in_place if self._zeroing_seen else self._applied.zeroed_in_place()
        if in_place:
            self._zeroed_grads = {i for i in self._kept_grads if self._experts[i][1].grad is None}
        elif in_place is False:
            self._kept_grads &= set(self._grads_this_step)

    def _zeroing_witnesses(self, dense: list[nn.Parameter]) -> list[nn.Parameter]:
        """The dense tensors whose gradients show whether the script zeroes the experts' (see
        _zeroing): the module's, where a module is known (model.zero_grad() zeroes those, not a
        tensor of another module a script put in the groups), else every dense tensor."""
        return dense if self._module is None else [p for p in dense if id(p) in self._names]

    def _check_swapped(self) -> None:
        """Refuse expert tensors that a script put into the groups in place of others (accelerate's
        FSDP2 preparation does, swapping each parameter for its sharded one after the optimizer was
        built): they have no hook, so torch's AdamW would step them as dense parameters here,
        silently, while the tensors SonarAdamW registered stay alive. Other new tensors are stepped
        as torch steps them. Looked at when a group's list of parameters is another one."""
        lists = tuple(id(g["params"]) for g in self.param_groups)
        if lists == self._group_lists:
            return
        self._group_lists = lists
        new = [p for g in self.param_groups for p in g["params"] if id(p) not in self._known]
        if not new:
            return
        names, in_module = self._names, self._in_module
        if self._module is not None:  # the module holds the new tensors under the old names, where it does
            names = dict(torch_params(self._module, None)[1])
            in_module = module_experts(self._module, None)
        experts = [names.get(id(p)) or self._label(p) for p in new
                   if is_expert(names.get(id(p)), p, self._pred, in_module)]
        if experts:
            raise RuntimeError(
                f"the parameter groups hold {len(experts)} expert tensor(s) SonarAdamW was not built with "
                f"({', '.join(experts[:3])}{', ...' if len(experts) > 3 else ''}), put there in place of others after it "
                "was built (accelerate's FSDP2 preparation swaps each parameter for its sharded one; Trainer with "
                "fsdp_version 2 builds the optimizer before it): they would be stepped as dense parameters, with "
                "no update during backward, while the tensors SonarAdamW registered stay in memory. Build "
                "SonarAdamW on the sharded model (after fully_shard; docs/distributed.md, section 4)")
        self._known.update(id(p) for p in new)

    def _forget_deleted_state(self) -> None:
        """Entries the script deleted (``del opt.state[p]``, ``clear()``) since the last step: a
        new one for the same tensor is a new entry, placed as torch places it (_order_state).
        Called before anything of the step can create entries again."""
        if self._ordered and self.state is self._ordered_in:
            self._ordered &= {id(k) for k in self.state}

    def _order_state(self) -> None:
        """torch creates a tensor's state at its first step, in the groups' order; the expert
        tensors' appear during backward, in backward's order. The entries that appeared since
        the last step are put in the groups' order (after the older ones), as torch has them,
        for scripts and state_dict hooks that go by the order of opt.state."""
        if self.state is not self._ordered_in:  # replaced by the script or load_state_dict
            self._ordered, self._ordered_in = set(), self.state
        new = [k for k in self.state if id(k) not in self._ordered]
        if not new:
            return
        place = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
        old = [(k, v) for k, v in self.state.items() if id(k) in self._ordered]
        new.sort(key=lambda k: place.get(id(k), len(place)))
        items = old + [(k, self.state[k]) for k in new]
        self.state.clear()  # the same dict: a script may hold it
        self.state.update(items)
        self._ordered = {id(k) for k in self.state}

    def _dense_step(self, dense: list[nn.Parameter], grad_scale: torch.Tensor | None,
                    found_inf: torch.Tensor | None) -> None:
        """torch.optim.AdamW.step over the dense parameters (``dense_parameters()``, after clipping)."""
        if found_inf is not None and bool(found_inf.item()):
            log.warning("skipping the dense step: a gradient overflowed (GradScaler)")
            if self._clipper is not None:
                self._clipper.skip_step()
            return
        dense_grads = [g for g in (p.grad for p in dense) if g is not None]
        if grad_scale is not None:
            # What GradScaler.unscale_ does (a multiply by the float32 reciprocal) for the
            # gradients torch's fused kernel would not be handed the scale for.
            inv_scale = grad_scale.double().reciprocal().float()
            for group in self.param_groups:
                if not self._fused_unscales(group):
                    for q in group["params"]:
                        if id(q) not in self._experts and q.grad is not None:
                            q.grad.mul_(inv_scale.to(q.grad.device))
        if self.nonfinite == "skip" and not all(bool(torch.isfinite(g).all()) for g in dense_grads):
            self._skipped_nonfinite += 1
            log.warning("skipping the dense step: a dense gradient is not finite")
            if self._clipper is not None:
                self._clipper.skip_step()
            return
        if self._clipper is not None:
            self._clip_globally(dense, dense_grads)
        elif self.max_grad_norm is not None and dense_grads:
            self.last_dense_grad_norm = clip_grad_norm(dense, self.max_grad_norm)
        for group in self.param_groups:
            sub = dict(group, params=[p for p in group["params"] if id(p) not in self._experts])
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            state_steps: list[torch.Tensor] = []
            has_complex = self._init_group(sub, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad=group["amsgrad"],
                 has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=dense_foreach(group, params, state_steps), capturable=group["capturable"],
                 differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=grad_scale if self._fused_unscales(group) else None,
                 found_inf=found_inf if self._fused_unscales(group) else None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])

    def _fused_unscales(self, group: Mapping[str, Any]) -> bool:
        """Whether torch's fused kernel would take this group's gradients still scaled and
        divide them by the scale itself. GradScaler hands the scale to torch.optim.AdamW only
        when it was built with ``fused=True``; otherwise its ``unscale_`` multiplies every
        gradient by the reciprocal first. With ``max_grad_norm`` the reference is AMP's recipe
        ``scaler.unscale_(opt)``, clip, ``scaler.step(opt)``: unscaled before the fused kernel too."""
        return bool(group["fused"]) and bool(self.defaults.get("fused")) and self.max_grad_norm is None

    def _clip_globally(self, dense: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """expert_clipping: this step's global norm (the server's expert norms and the dense
        norm); the dense gradients are clipped by it as clip_grad_norm_(all params) would, and
        it fixes the factor of the next step's expert gradients."""
        assert self._clipper is not None and self.max_grad_norm is not None
        dense_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        self.last_dense_grad_norm = dense_norm
        global_norm = self._clipper.finish_step(float(dense_norm) ** 2)
        if grads:
            torch.nn.utils.clip_grads_with_norm_(dense, self.max_grad_norm,
                                                 torch.tensor(global_norm, dtype=torch.float32))

    @property
    def last_global_grad_norm(self) -> float | None:
        """expert_clipping: the last step's norm over all gradients (experts measured by the
        server before scaling); None without expert_clipping or before the first step."""
        return self._clipper.last_global_norm if self._clipper is not None else None

    @property
    def last_expert_grad_scale(self) -> float | None:
        """expert_clipping: the factor the last step's expert gradients were multiplied by."""
        return self._clipper.last_scale if self._clipper is not None else None

    @property
    def next_expert_grad_scale(self) -> float | None:
        """expert_clipping: the factor the coming step's expert gradients will be multiplied by."""
        return self._clipper.scale if self._clipper is not None else None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's state_dict, the expert moments fetched from the server: it loads
        into torch.optim.AdamW over the same parameters and trains on bitwise."""
        self._check_usable()
        if self._busy:
            raise RuntimeError(
                "SonarAdamW.state_dict() was called while SonarAdamW was in the middle of an update: a signal "
                "handler interrupted its backward hook or step() and asked for the state there, where the step "
                "is half sent. Set a flag in the handler and save the checkpoint after step() returns")
        self._settle()  # micro-batches still to come stay pending: torch's state is that before the step
        self._write_back_state()  # nothing is in flight now
        entries: dict[int, dict[str, Any]] = {}
        by_amsgrad: dict[bool, list[nn.Parameter]] = {}
        for _, (_, p) in self._grouped():
            if isinstance(self.state.get(p), ExpertState):
                by_amsgrad.setdefault(self._registered[id(p)]["amsgrad"], []).append(p)
        for amsgrad, ps in by_amsgrad.items():
            with self._backend.state_transfer(amsgrad) as xfer:
                for p, moments in zip(ps, xfer.fetch_all(ps)):
                    entry: dict[str, Any] = {"step": self.state[p]["step"].clone()}
                    entry.update((k, v) for k, v in moments.items() if amsgrad or k != "max_exp_avg_sq")
                    entries[id(p)] = entry
        # torch's state_dict packs self.state and runs the state_dict hooks on the result: it
        # packs a view of it with the expert entries fetched, so that the hooks see them
        live = self.state
        view: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for k, v in live.items():
            view[k] = entries.get(id(k), v)
        self.state = view
        try:
            sd = super().state_dict()
        finally:
            self.state = live
        if self._clipper is not None:
            sd["sonar_expert_clipping"] = self._clipper.state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of SonarAdamW or torch.optim.AdamW (older ones too, as torch
        loads them), all or nothing: it replaces every parameter's state, the expert
        moments on the server."""
        self._check_usable()
        self._settle()  # micro-batches accumulated so far stay pending: torch keeps .grad through a load
        old_state, old_groups = self.state, self.param_groups
        old_clipping = self._clipper.state() if self._clipper is not None else None
        try:
            clipping = state_dict.get("sonar_expert_clipping")
            if clipping is not None and self._clipper is not None:
                self._clipper.load(clipping)
            super().load_state_dict(state_dict)
            grouped = [e for _, e in self._grouped()]
            loaded = {id(p): self.state.get(p) for _, p in grouped}
            for name, p in grouped:
                self._check_loaded(name, p, loaded[id(p)])
        except BaseException:
            self.state, self.param_groups = old_state, old_groups
            if self._clipper is not None and old_clipping is not None:
                self._clipper.load(old_clipping)  # a refused dict changes nothing, the clipping factor neither
            raise
        done = 0
        try:
            for amsgrad in (False, True):
                ps = [p for _, p in grouped if self._registered[id(p)]["amsgrad"] == amsgrad]
                if not ps:
                    continue
                # no state in the dict: as torch, the tensor starts afresh
                states: dict[int, Mapping[str, Any]] = {id(p): st for p in ps if (st := loaded[id(p)])}
                steps = {i: _loaded_step(st["step"]) for i, st in states.items()}

                def stored(p: nn.Parameter, amsgrad: bool = amsgrad) -> None:
                    nonlocal done
                    step = steps.get(id(p))
                    if step is not None:
                        self.state[p] = ExpertState(self._fetcher(p), step, amsgrad)
                    else:
                        self.state.pop(p, None)
                    self._server_steps[id(p)] = int(step.item()) if step is not None else 0
                    done += 1
                with self._backend.state_transfer(amsgrad) as xfer:
                    xfer.store_all([(p, int(steps[id(p)].item()), states[id(p)]) if id(p) in steps else (p, 0, {})
                                    for p in ps], stored)
        except SonarError as e:  # checked above: the server failed (or refused) mid-way
            raise SonarError(f"load_state_dict failed after the state of {done} of {len(grouped)} expert "
                             f"tensors went to sonard, so the optimizer's state is partly loaded: load a "
                             f"state_dict again before training on ({e})") from e

    def _check_loaded(self, name: str, p: nn.Parameter, st: Mapping[str, Any] | None) -> None:
        """Refuse, before the server is touched, state the server could not take."""
        g = self._group_of(p)
        registered = self._registered[id(p)]
        if bool(g["amsgrad"]) != registered["amsgrad"]:
            raise ValueError(f"the state_dict sets amsgrad={g['amsgrad']} for expert tensor {name}, registered with "
                             f"amsgrad={registered['amsgrad']}: build the SonarAdamW with the options of the state_dict")
        if not st:
            return
        if "step" not in st:
            raise ValueError(f"state of expert tensor {name} has no 'step'")
        try:
            _loaded_step(st["step"])
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"state of expert tensor {name}: {e}") from e
        for k in STATE_KEYS:
            v = st.get(k)
            if v is None:
                if k != "max_exp_avg_sq" or g["amsgrad"]:
                    raise ValueError(f"state of expert tensor {name} lacks {k!r}")
                continue
            if not isinstance(v, torch.Tensor) or v.shape != p.shape:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"state {k} of expert tensor {name} has shape {shape}, want {tuple(p.shape)}")
            local_state(name, k, p, v)

    # ------------------------------------------------------------ reporting
    def stats(self, server: bool = True) -> dict[str, Any]:
        """Client figures (peak expert-gradient bytes, requests, latencies, seconds spent handing
        gradients over and waiting for updates, where the latest step requests' time went) and,
        with server=True, the server's counters."""
        lat = sorted(self._backend.request_latencies)
        out: dict[str, Any] = {
            **self._backend.stats(),
            "namespace": self.namespace,
            "expert_tensors": len(self._experts),
            "dense_tensors": len(self.dense_parameters()),
            "skipped_nonfinite": self._skipped_nonfinite,
            "hand_over_s": self._hand_over_s,
            "wait_s": self._wait_s,
            "requests": self._backend.requests_answered,
            # over the latest requests (RECENT_REQUESTS)
            "latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else 0.0,
            "latency_ms_p99": 1e3 * lat[min(len(lat) - 1, len(lat) * 99 // 100)] if lat else 0.0,
            "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else 0.0,
            "step_us_p50": RequestTrace.median_segments([t for t in self._backend.request_traces if t.op == "step"]),
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
        from .distributed import unwatch  # distributed imports this module
        unwatch(self)
        try:
            self._backend.close()
        finally:
            for h in self._hooks.values():
                h.remove()
            self._hooks.clear()
            self._outputs.close()
            for _, p in self._experts.values():
                if _owner(p) is self:
                    del _OWNERS[id(p)]

    def __enter__(self) -> SonarAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> SonarAdamW:
        raise TypeError("SonarAdamW cannot be copied: its expert state lives in a sonard session. Copy "
                        "opt.state_dict() and load it into a new SonarAdamW (or torch.optim.AdamW)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("SonarAdamW cannot be pickled: its expert state lives in a sonard session. Save "
                        "opt.state_dict() and load it into a new SonarAdamW (or torch.optim.AdamW)")
