"""Which torch releases sonar_moe works with, checked when the package is imported.

SonarAdamW subclasses ``torch.optim.AdamW`` and runs its dense step through torch's own
bookkeeping (``Adam._init_group``, the functional ``adam()`` with ``decoupled_weight_decay``),
which took their present form in torch 2.7, when AdamW became a kind of Adam. Each release from
2.7 on that ``scripts/torch-versions`` ran passed the bit-for-bit tests against its own AdamW
(docs/versions.md); 2.1, 2.4 and 2.6 failed at their first step, so an older one is refused
here, with what to do, instead of there.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 7)


def torch_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (this torch's by default); a pre-release or
    local build counts as its release; None if it cannot be read."""
    m = re.match(r"(\d+)\.(\d+)", version if version is not None else torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_torch(version: str | None = None) -> None:
    """Raise ImportError for a torch older than MIN_TORCH (this torch's by default). A version
    string that cannot be read passes: a source build may name itself anything."""
    v = version if version is not None else torch.__version__
    release = torch_release(v)
    if release is not None and release < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"sonar_moe needs torch >= {need}, and this is torch {v}: SonarAdamW builds on torch.optim.AdamW "
            f"as torch {need} made it (a kind of Adam), and its updates are checked bit for bit against "
            f"torch {need} and later. Upgrade torch: pip install 'torch>={need}'")
