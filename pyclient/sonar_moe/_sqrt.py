"""Which float32 sqrt this process's torch uses, and whether a sonard session matches it.

Each client names its library in ``hello`` (``sqrt_lib``: a path, or ``""`` for the IEEE
sqrt); the server loads it for that session and answers ``sqrt`` with ``"ieee"`` or
``"mkl:<path>"``, which :func:`check_session_sqrt` compares with what this torch needs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Iterable

import torch

from ._connection import SonarError

log = logging.getLogger("sonar_moe")

VML_HA_MODE = 0x2 | 0x140000 | 0x100  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as ATen calls MKL


@functools.cache
def torch_sqrt_library() -> str | None:
    """The library whose float32 sqrt torch uses, when it is not the IEEE one.

    On x86, ATen computes float32 ``sqrt`` with MKL's ``vmsSqrt`` (high-accuracy mode),
    linked into libtorch_cpu.so; on AVX-512 machines about 0.6% of its results are one
    ulp below the IEEE square root. Returns that library's path when ``vmsSqrt`` is
    exported and reproduces ``torch.sqrt`` on a probe; None otherwise.
    """
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(lib).vmsSqrt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    probe = _sqrt_probe()
    out = torch.empty_like(probe)
    fn(probe.numel(), probe.data_ptr(), out.data_ptr(), VML_HA_MODE)
    return lib if torch.equal(out, torch.sqrt(probe)) else None


def torch_sqrt_is_ieee() -> bool:
    """Whether torch's float32 sqrt is correctly rounded on the probe."""
    probe = _sqrt_probe()
    return torch.equal(torch.sqrt(probe), torch.sqrt(probe.double()).float())


@functools.cache
def _sqrt_probe() -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    mant = torch.rand(1 << 18, generator=g) + 0.5
    exps = torch.randint(-60, 20, (1 << 18,), generator=g).float()
    return (mant * torch.exp2(exps)).contiguous()


def needed_sqrt_lib(dtypes: Iterable[torch.dtype]) -> str:
    """``hello``'s ``sqrt_lib`` for expert tensors of these dtypes: the library of this torch's
    float32 sqrt when there are float32 tensors and it is not the IEEE one, else ``""`` (bfloat16
    tensors always use the IEEE sqrt, in torch and in sonard)."""
    return (torch_sqrt_library() or "") if torch.float32 in set(dtypes) else ""


def check_session_sqrt(server_sqrt: str) -> None:
    """The session's float32 sqrt (hello's ``sqrt`` reply) must be the one this torch uses
    (for a client with float32 expert tensors)."""
    lib = torch_sqrt_library()
    if lib is None:
        if server_sqrt != "ieee":
            log.warning("sonard uses %s for float32 sqrt but this torch does not: updates may differ in the last bit", server_sqrt)
        elif not torch_sqrt_is_ieee():
            log.warning("this torch's float32 sqrt is neither IEEE nor MKL vmsSqrt: updates may differ in the last bit")
        return
    if server_sqrt == "ieee":
        raise SonarError(
            f"this torch computes float32 sqrt with MKL's vmsSqrt from {lib}, which this client named in hello "
            "(sqrt_lib), but sonard answered that this session uses the IEEE sqrt: updates would differ from "
            "torch.optim.AdamW in the last bit. Use a sonard of this client's version (it loads each client's "
            "library), on the same machine and user as this process")
    if os.path.realpath(server_sqrt.removeprefix("mkl:")) != os.path.realpath(lib):
        log.warning("sonard's float32 sqrt comes from %s, this torch's from %s", server_sqrt, lib)
