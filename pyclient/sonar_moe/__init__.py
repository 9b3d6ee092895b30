"""Sonar-MoE: AdamW for Mixture-of-Experts expert tensors, applied during backward.

``SonarAdamW`` is a drop-in ``torch.optim.Optimizer``: expert tensors are handed to the
``sonard`` server the moment their gradient is final and updated there, so at most one
layer of expert gradients is alive; dense parameters keep standard AdamW with optional
global-norm clipping.

Modules: ``optimizer`` (SonarAdamW: the torch.optim.Optimizer bookkeeping, dense AdamW, step
counters, state_dict), ``_backend`` (the expert-backend interface and what the server paths
share: registration, step requests per layer, accumulation, state transfer), ``_shm_backend``
(CPU: shared-memory parameters and gradient ring, over ``_shm``), ``_cuda_backend`` (CUDA:
tensors registered in place, over ``_cuda``'s IPC handles and event), ``_steps`` (step
requests grouped per layer), ``_connection`` (the socket and protocol), ``_launch`` (a private
sonard), ``_binary`` (finding sonard), ``_sqrt`` (this torch's float32 sqrt, named in hello),
``_detect`` (which parameters are experts: ``find_experts`` on a module, ``is_expert_param`` on a name), ``_requires``
(the torch releases it works with, checked at import), ``checkpoint``, ``hf``, ``distributed``.

For tools and tests that speak the protocol themselves: ``Connection`` (one socket to a sonard),
``start_private_server`` and ``torch_sqrt_library`` (the library this torch's float32 sqrt needs,
or None).
"""

from ._requires import check_torch

check_torch()  # before anything that builds on torch.optim.AdamW

from ._binary import find_sonard
from ._connection import PROTOCOL_VERSION, Connection, RequestTrace, SonarError, SonarRefused, SonarServerDied
from ._detect import ExpertTensor, find_experts, group_key, is_expert_param
from ._shm import ShmFullError
from ._launch import start_private_server
from ._sqrt import torch_sqrt_library
from ._version import __version__
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .optimizer import NoExpertsWarning, SonarAdamW, torch_fused_cuda_scalars, torch_fused_scalars, torch_scalars

__all__ = [
    "__version__",
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
    "PROTOCOL_VERSION",
    "Connection",
    "RequestTrace",
    "SonarRefused",
    "start_private_server",
    "torch_sqrt_library",
    "SonarAdamW",
    "SonarError",
    "SonarServerDied",
    "ShmFullError",
    "find_sonard",
    "ExpertTensor",
    "find_experts",
    "group_key",
    "is_expert_param",
    "torch_fused_cuda_scalars",
    "NoExpertsWarning",
    "torch_fused_scalars",
    "torch_scalars",
]
