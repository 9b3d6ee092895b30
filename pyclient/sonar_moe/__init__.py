"""Sonar-MoE: AdamW for Mixture-of-Experts expert tensors, applied during backward.

``SonarAdamW`` is a drop-in ``torch.optim.Optimizer``: expert tensors are handed to the
``sonard`` server the moment their gradient is final and updated there, so at most one
layer of expert gradients is alive; dense parameters keep standard AdamW with optional
global-norm clipping.
"""

from ._client import PROTOCOL_VERSION, SonarError, SonarServerDied, find_sonard
from ._detect import group_key, is_expert_param
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .optimizer import SonarAdamW, torch_scalars

from ._version import __version__
__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
    "PROTOCOL_VERSION",
    "SonarAdamW",
    "SonarError",
    "SonarServerDied",
    "find_sonard",
    "group_key",
    "is_expert_param",
    "torch_scalars",
]
