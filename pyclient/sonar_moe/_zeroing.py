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

The same gradients tell how ``model.zero_grad()`` zeroed: in place (``set_to_none=False``: the
same tensors, zeroed) or to None. After the first, torch steps an expert tensor the next backward
gives no gradient with the zero it keeps, as after ``opt.zero_grad(set_to_none=False)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


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
