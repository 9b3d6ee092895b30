"""Whether the gradients a ``step()`` applied were zeroed before the next step.

torch's AdamW keeps every ``.grad`` until the script zeroes it: a backward with no
``zero_grad()`` since the last ``step()`` adds its gradients to those, and a second ``step()``
with no backward applies them again. SonarAdamW consumes each expert gradient during backward,
so in both cases it would train differently, silently (red team, 2026-12-06). It cannot see
``model.zero_grad()`` (the module's, which Trainer calls), only its own ``zero_grad()``; what it
can see is the dense gradients the step applied. A dense gradient still in its ``.grad``
afterwards, the same tensor at the same version, was not zeroed: ``zero_grad()`` sets it to
``None`` or zeroes it in place (a new version), and a backward that reaches that tensor adds to
it in place (a new version) or replaces it. SonarAdamW looks when backward reaches the
model's output (before autograd adds to any), else at the first expert gradient, where the dense
tensors autograd reaches later (the embeddings, the layers below) still hold theirs.

Where backward starts is the output of the module that runs the model (:class:`ModelOutputs`):
the module SonarAdamW was built on, or whatever wraps it or stands for it when called (DDP,
``torch.compile``'s module, the model of parameters given without it), found at the first
forward after a step.

The same gradients tell how ``model.zero_grad()`` zeroed: in place (``set_to_none=False``: the
same tensors, zeroed) or to None. After the first, torch steps an expert tensor the next backward
gives no gradient with the zero it keeps, as after ``opt.zero_grad(set_to_none=False)``. That is
told where the step's check looks first: later, DDP with ``gradient_as_bucket_view=True`` has put
the same view of its bucket back in each ``.grad`` it filled, zeroed or not.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle


class AppliedGrads:
    """The dense gradients one ``step()`` applied, and whether it updated expert tensors (torch
    would still hold a ``.grad`` for each of those)."""

    def __init__(self, dense: Iterable[torch.Tensor], experts_updated: bool) -> None:
        # the tensor held weakly: zero_grad() frees it; its version counter (Tensor._version,
        # which torch's own tests read) changes with every in-place write
        grads = ((p, p.grad) for p in dense)
        self._grads = [(p, weakref.ref(g), g._version) for p, g in grads if g is not None]
        self._experts_updated = experts_updated

    def zeroed_in_place(self) -> bool | None:
        """How the script zeroed the gradients since that step (by ``model.zero_grad()`` or by
        hand; None: no dense gradient to tell by). True: in place (``set_to_none=False``): a dense
        tensor holds the same gradient tensor (zeroed, maybe added to since). False: set to None:
        each holds None or another tensor."""
        if not self._grads:
            return None
        for p, ref, _ in self._grads:
            g = p.grad
            if g is not None and g is ref():
                return True
        return False

    def still_held(self) -> torch.Tensor | None:
        """A dense tensor whose ``.grad`` is still the one the step applied, unchanged (None:
        none, or the step updated no expert tensor, so torch keeps no gradient SonarAdamW lacks)."""
        if not self._experts_updated:
            return None
        for p, ref, version in self._grads:
            g = p.grad
            if g is not None and g is ref() and g._version == version:
                return p
        return None


class ModelOutputs:
    """Puts the zeroing check's forward hook (``forward_hook``, which hooks the gradient of the
    forward's output: backward reaches it before any parameter of the model) on the modules that
    run the model being trained.

    The module SonarAdamW was built on is hooked from the start (:meth:`hook`). After each
    step, :meth:`arm` also looks for the module the script actually calls: a global forward
    pre-hook sees each module about to run, outermost first, and hooks the first whose
    parameters include the optimizer's expert tensors (``runs_experts``; None once the optimizer
    is gone), then stops looking. That finds a module that wraps the model (DDP, the module
    ``torch.compile`` returns, which runs its hooks as written where the model's own are traced)
    and the model of an optimizer built from its parameters alone. Armed only until that forward,
    so other modules pay for the global hook only in between.
    """

    def __init__(self, forward_hook: Callable[[nn.Module, Any, Any], None],
                 runs_experts: Callable[[nn.Module], bool | None]) -> None:
        self._forward_hook = forward_hook
        self._runs_experts = runs_experts
        self._hooked: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()
        self._known: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._watch: RemovableHandle | None = None

    def hook(self, module: nn.Module) -> None:
        """Put the forward hook on ``module`` (once)."""
        if module not in self._hooked:
            self._hooked[module] = module.register_forward_hook(self._forward_hook)

    def arm(self) -> None:
        """Look for the module that runs the model at the next forward (see the class)."""
        if self._watch is None:
            self._watch = register_module_forward_pre_hook(self._before_forward)

    def disarm(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def close(self) -> None:
        self.disarm()
        for handle in list(self._hooked.values()):
            handle.remove()
        self._hooked.clear()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        runs = self._known.get(module)
        if runs is None:
            runs = self._runs_experts(module)
            if runs is None:  # the optimizer is gone
                self.disarm()
                return
            self._known[module] = runs
        if runs:
            self.disarm()
            self.hook(module)
