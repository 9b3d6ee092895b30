"""Expert clipping without a second backward (``SonarAdamW(expert_clipping=...)``).

Global-norm clipping needs the norm of *all* gradients before any is applied, but Sonar
applies each expert tensor's gradient during backward. Here the expert gradients of step t
are multiplied by a factor fixed before step t began, from what earlier steps measured:

- the server returns the squared L2 norm of every expert gradient it applies (one pass over
  the gradient, just before the AdamW arithmetic, no extra memory);
- at ``step()`` the client adds the dense gradients' squared norm: that is step t's global
  norm ``G_t``, exactly the one ``clip_grad_norm_(all params)`` would compute (up to the
  order of the float sums), and the dense gradients are clipped by it, as global clipping
  would clip them;
- the experts of step t+1 get ``min(1, c / (E_t + 1e-6))`` (torch's clip coefficient, in
  float32), where the estimate ``E_t`` is
  - ``"prev_global"``: ``G_t``, the previous step's global norm;
  - ``"running"``: a bias-corrected exponential moving average of ``G_1 .. G_t`` (decay 0.9).

The first step has no estimate: its expert gradients are not scaled. With gradient
accumulation the factor multiplies the summed gradient, once, when it is applied.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MODES = ("prev_global", "running")
RUNNING_DECAY = 0.9


def clip_coef(max_norm: float, norm: float) -> float:
    """torch's ``clip_grad_norm_`` coefficient for a float32 total norm, clamped to 1."""
    total = torch.tensor(norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


class ExpertClipper:
    """The factor for the expert gradients of the coming step, from the norms of past steps."""

    def __init__(self, mode: str, max_norm: float) -> None:
        if mode not in MODES:
            raise ValueError(f"expert_clipping must be one of {', '.join(map(repr, MODES))} or None, got {mode!r}")
        self.mode = mode
        self.max_norm = float(max_norm)
        self.scale = 1.0  # multiplies the expert gradients applied in the current step
        self.last_scale = 1.0  # the factor the last finished step's expert gradients got
        self.last_global_norm: float | None = None
        self.last_expert_sq_norm = 0.0
        self._expert_sq = 0.0  # this step's expert gradients so far (server replies)
        self._ema = 0.0
        self._steps = 0

    def add_expert_sq_norms(self, sq_norms: list[float]) -> None:
        """Squared norms of expert gradients the server applied in this step."""
        self._expert_sq += math.fsum(float(x) for x in sq_norms)

    def finish_step(self, dense_sq_norm: float) -> float:
        """Close the step: return its global norm and fix the next step's expert factor."""
        global_norm = math.sqrt(dense_sq_norm + self._expert_sq)
        self.last_expert_sq_norm = self._expert_sq
        self._expert_sq = 0.0
        self.last_global_norm = global_norm
        self.last_scale = self.scale
        self._steps += 1
        if self.mode == "prev_global":
            estimate = global_norm
        else:
            self._ema = RUNNING_DECAY * self._ema + (1 - RUNNING_DECAY) * global_norm
            estimate = self._ema / (1 - RUNNING_DECAY ** self._steps)
        self.scale = clip_coef(self.max_norm, estimate) if math.isfinite(estimate) else 1.0
        return global_norm

    def skip_step(self) -> None:
        """The step was skipped (an overflow, a non-finite gradient): forget its expert norms,
        keep the estimate and the factor."""
        self._expert_sq = 0.0

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "scale": self.scale, "ema": self._ema, "steps": self._steps,
                "last_global_norm": self.last_global_norm}

    def load(self, st: dict[str, Any]) -> None:
        if st.get("mode") != self.mode:
            raise ValueError(f"the state_dict's expert clipping is {st.get('mode')!r}, this optimizer's {self.mode!r}")
        self.scale = float(st["scale"])
        self._ema = float(st["ema"])
        self._steps = int(st["steps"])
        self.last_global_norm = st.get("last_global_norm")
        self._expert_sq = 0.0
