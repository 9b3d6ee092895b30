"""The CUDA path (docs/gpu.md): CUDA expert tensors stay in GPU memory and sonard updates
them in place.

Parameters are registered by CUDA IPC handle instead of being copied into shared memory. A
gradient is shared the same way; one interprocess event recorded after it is final orders
the server's kernels (``wait_event``) without any host synchronization. The gradient is kept
referenced until the reply: the server has finished with it then. No ring, no shared memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ._backend import Counter, BackendOptions, Expert, MemRef, ServerBackend, Staged, Transfer, no_ref
from ._connection import Connection, SonarError
from ._cuda import CudaIpc

log = logging.getLogger("sonar_moe")


class CudaBackend(ServerBackend):
    """CUDA expert tensors, all on one device, shared with the server by IPC handle."""

    _step_body: ClassVar[Mapping[str, Any]] = {"wait_event": True}

    @classmethod
    def _check_devices(cls, devices: set[torch.device]) -> None:
        if len(devices) != 1:
            names = ", ".join(sorted(str(d) for d in devices))
            raise NotImplementedError(f"expert tensors on several devices ({names}): put all expert tensors on one CUDA device")
        (dev,) = devices
        if dev.type != "cuda":
            raise NotImplementedError(f"expert tensors on {dev}: only CPU or CUDA expert tensors are supported")

    def __init__(self, conn: Connection, hello: Mapping[str, Any], named: list[tuple[str, nn.Parameter]],
                 options: BackendOptions, counter: Counter, slices: Mapping[int, int] | None = None) -> None:
        super().__init__(conn, hello, named, options, counter, slices)
        dev = named[0][1].device
        if not hello.get("cuda"):
            raise SonarError(f"expert tensors are on {dev} but this sonard has no CUDA path (no CUDA driver where it "
                             "runs, or --cuda-device -1); sonard must run on the same machine as the GPU")
        self._ipc = CudaIpc(conn, dev)
        log.info("sonard updates the expert tensors on %s (%s)", dev, hello.get("cuda"))

    def _param_ref(self, e: Expert) -> MemRef:
        return self._ipc.param_ref(e.tensor)

    def _stage(self, e: Expert, grad: torch.Tensor, owned: bool) -> Staged:
        """Share the gradient by handle and record the event; keep it until the reply."""
        p, clip = e.param, self._options.max_expert_grad_norm
        if clip is not None:
            # Per-tensor clipping, exactly clip_grad_norm_([p], c); a caller's gradient stays untouched.
            if not owned:
                grad = grad.clone()
            saved, p.grad = p.grad, grad
            try:
                torch.nn.utils.clip_grad_norm_([p], clip)
            finally:
                p.grad = saved
        if owned:
            p.grad = None
        self._conn.poll(0)  # release the gradients of finished requests
        ref, holder = self._ipc.grad_ref(grad.contiguous())
        del grad
        self._ipc.record()
        return Staged(ref["seg"], ref["off"], holder)

    def _release(self, token: Any) -> None:
        self._ipc.release(token)

    def _open_transfer(self, amsgrad: bool) -> Transfer:
        return CudaTransfer(self._conn, self._experts, amsgrad, self._ipc)

    def _close_memory(self) -> None:
        self._ipc.close()


class CudaTransfer(Transfer):
    """State buffers on the device, shared by handle, kept until the batch is done."""

    def __init__(self, conn: Connection, experts: Mapping[int, Expert], amsgrad: bool, ipc: CudaIpc) -> None:
        super().__init__(conn, experts, amsgrad)
        self._ipc = ipc
        self._held: list[Any] = []  # the IPC holders of the batch's buffers
        self._batch_bytes = 0

    def _slot(self, e: Expert) -> tuple[list[torch.Tensor], list[MemRef]] | None:
        nbytes = self._n * e.nbytes
        if self._held and self._batch_bytes + nbytes > self.BATCH_BYTES:
            return None
        views = [torch.zeros_like(e.tensor, memory_format=torch.contiguous_format) for _ in range(self._n)]
        refs = []
        for v in views:
            ref, holder = self._ipc.grad_ref(v)
            self._held.append(holder)
            refs.append(ref)
        self._batch_bytes += nbytes
        return views, refs

    def _views(self, e: Expert, slot: Any) -> list[torch.Tensor]:
        return slot[0]

    def _ready(self) -> None:
        self._ipc.synchronize()  # the buffers' writes are done before the server copies

    def _refs(self, e: Expert, slot: Any, part: int) -> list[MemRef]:
        refs = [{**r, "off": r["off"] + part * e.part_bytes, "nbytes": e.part_bytes} for r in slot[1]]
        return refs + [no_ref() for _ in range(3 - len(refs))]

    def _reset(self) -> None:
        self.close()

    def close(self) -> None:
        held, self._held = self._held, []
        self._batch_bytes = 0
        for holder in held:
            self._ipc.release(holder)
