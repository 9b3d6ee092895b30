"""CUDA IPC for the client (docs/gpu.md): memory and event handles that sonard opens.

A tensor's memory is shared by the handle of its base block in torch's caching allocator
(``attach_cuda``, once per block, then a MemRef with the offset). One interprocess event,
recorded after each gradient is final, orders the server's kernels after the producing work
(``cuda_event``, then steps with ``wait_event``). Used by :class:`~._cuda_backend.CudaBackend`.
"""

from __future__ import annotations

from typing import Any

import torch

from ._connection import Connection

MemRef = dict[str, int]


class CudaIpc:
    """IPC handles, segments and the interprocess event of one session's CUDA tensors."""

    def __init__(self, conn: Connection, device: torch.device) -> None:
        self._conn = conn
        self.device = device
        self._segs: dict[bytes, int] = {}  # base block's handle -> server segment
        self._param_counters: list[tuple[Any, int]] = []  # released at close
        with torch.cuda.device(device):
            self._ev = torch.cuda.Event(interprocess=True)
            self._ev.record()
        conn.call("cuda_event", {"handle": bytes(self._ev.ipc_handle())})

    def _share(self, t: torch.Tensor) -> tuple[MemRef, tuple[Any, int]]:
        """A MemRef of t's memory, attaching its base block once; and its IPC ref counter."""
        if not t.is_contiguous():
            raise ValueError("CUDA expert tensors and their gradients must be contiguous")
        st = t.untyped_storage()
        _dev, handle, _size, off, rc_handle, rc_offset, _ev, _sync = st._share_cuda_()
        handle = bytes(handle)
        seg = self._segs.get(handle)
        if seg is None:
            seg = int(self._conn.call("attach_cuda", {"handle": handle, "size": int(off) + st.nbytes()})["seg"])
            self._segs[handle] = seg
        ref = {"seg": seg, "off": int(off) + int(t.storage_offset()) * t.element_size(),
               "nbytes": int(t.numel()) * t.element_size()}
        return ref, (rc_handle, int(rc_offset))

    def param_ref(self, p: torch.Tensor) -> MemRef:
        """The MemRef of a parameter, registered in place."""
        ref, rc = self._share(p.detach())
        self._param_counters.append(rc)
        return ref

    def grad_ref(self, g: torch.Tensor) -> tuple[MemRef, list[Any]]:
        """Share a gradient (or a state buffer): its MemRef and a holder to keep until the reply."""
        ref, rc = self._share(g)
        return ref, [g, rc]

    def record(self) -> None:
        """Mark the current stream's work so far: the next wait_event request waits for it."""
        self._ev.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Wait until this device's work so far is done (before the server copies a buffer)."""
        torch.cuda.synchronize(self.device)

    def release(self, holder: list[Any]) -> None:
        """After the reply: give back the IPC ref counter, then drop the tensor (in that order,
        so its storage returns to the caching allocator instead of torch's IPC limbo)."""
        if holder[1] is not None:
            self._release_counter(holder[1])
        holder[0] = holder[1] = None

    def _release_counter(self, rc: tuple[Any, int]) -> None:
        torch.UntypedStorage._release_ipc_counter(rc[0], rc[1], device=self.device)

    def close(self) -> None:
        """After the server released the session: give back the parameters' counters."""
        counters, self._param_counters = self._param_counters, []
        for rc in counters:
            try:
                self._release_counter(rc)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
