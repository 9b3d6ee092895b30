"""The shared-memory path: CPU expert tensors, updated by sonard's CPU kernels.

The parameters move into one POSIX shared-memory segment for good (each at a page
boundary). Autograd allocates gradients in private memory, so each gradient is copied into
a slot of a ring (sized to ``ring_layers`` of the largest layer), freed at once, and the
slot is given back when the server has answered the request that read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._backend import Counter, BackendOptions, Expert, MemRef, ServerBackend, Staged, Transfer, no_ref, say_hello
from ._connection import Connection, SonarError, SonarRefused
from ._shm import PAGE, Ring, Segment
from ._sqrt import check_session_sqrt, needed_sqrt_lib


def attach(conn: Connection, seg: Segment) -> int:
    """Have the server map `seg` (it unlinks the name); its segment id."""
    try:
        return int(conn.call("attach", {"shm": seg.name, "size": seg.size})["seg"])
    finally:
        seg.unlink()


class ShmBackend(ServerBackend):
    """CPU expert tensors in shared memory; gradients through a slot ring."""

    @classmethod
    def _hello(cls, conn: Connection, named: list[tuple[str, nn.Parameter]], options: BackendOptions) -> dict[str, Any]:
        """Name this torch's float32 sqrt library: the server computes float32 sqrt with it for
        this session; check that it does."""
        dtypes = {p.dtype for _, p in named}
        lib = needed_sqrt_lib(dtypes)
        try:
            rep = say_hello(conn, options.namespace, {"sqrt_lib": lib}, options.timeout)
        except SonarRefused as e:
            if not lib:
                raise
            raise SonarRefused(
                f"{e}. This torch computes float32 sqrt with MKL's vmsSqrt from {lib}, and float32 expert "
                "tensors are bitwise equal to torch.optim.AdamW only when sonard calls that same function; "
                "an ipc:// sonard of this user on this host loads a client's library, a tcp:// one only those "
                "its operator trusts: use server=None (a private sonard), an ipc:// server, a tcp:// sonard "
                f"started with --trusted-sqrt-lib {lib}, or bfloat16 expert tensors") from e
        if torch.float32 in dtypes:
            check_session_sqrt(str(rep.get("sqrt", "")))
        return rep

    def __init__(self, conn: Connection, hello: Mapping[str, Any], named: list[tuple[str, nn.Parameter]],
                 options: BackendOptions, counter: Counter, slices: Mapping[int, int] | None = None) -> None:
        super().__init__(conn, hello, named, options, counter, slices)
        self._params: list[Segment] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (segment id, offset)
        self._views: dict[int, torch.Tensor] = {}  # id(param) -> its memory in the segment
        self._ring: Ring | None = None
        self._ring_seg = 0
        self._alive = 0
        self._place(list(self._experts.values()))

    def _place(self, experts: list[Expert]) -> None:
        """Move the parameters into a new shared segment for good (each at a page boundary) and
        make the gradient ring large enough for ring_layers of the largest layer."""
        offsets, off = [], 0
        for e in experts:
            offsets.append(off)
            off += -(-e.nbytes // PAGE) * PAGE
        seg = Segment(off, "params")
        seg_id = attach(self._conn, seg)
        self._params.append(seg)
        for e, o in zip(experts, offsets):
            view = seg.tensor(o, e.param.dtype, e.param.shape)
            with torch.no_grad():
                view.copy_(e.param)
            e.param.data = view
            self._where[id(e.param)] = (seg_id, o)
            self._views[id(e.param)] = view
        layer: dict[str, int] = {}
        for e in self._experts.values():
            layer[e.layer] = layer.get(e.layer, 0) + Ring.slot_bytes(e.nbytes)
        need = max(layer.values()) * self._options.ring_layers
        if self._ring is None or self._ring.capacity < need:  # no gradient is in flight here
            if self._ring is not None:
                self._conn.call("detach", {"seg": self._ring_seg})  # the mapping goes with the last view
            self._ring = Ring(need, "ring")
            self._ring_seg = attach(self._conn, self._ring.segment)

    def reclaim(self, param: nn.Parameter) -> bool:
        view = self._views.get(id(param))
        if view is None or param.data_ptr() == view.data_ptr():
            return False
        if param.device.type != "cpu" or param.dtype != view.dtype or param.shape != view.shape:
            return False
        with torch.no_grad():
            view.copy_(param.detach())
        param.data = view
        return True

    def _param_ref(self, e: Expert) -> MemRef:
        seg, off = self._where[id(e.param)]
        return {"seg": seg, "off": off, "nbytes": e.nbytes}

    def _stage(self, e: Expert, grad: torch.Tensor, owned: bool) -> Staged:
        """Copy the gradient into a ring slot (freeing the original when owned)."""
        p, clip = e.param, self._options.max_expert_grad_norm
        if clip is not None and owned:
            # Per-tensor clipping, exactly clip_grad_norm_([p], c): NOT global-norm clipping.
            torch.nn.utils.clip_grad_norm_([p], clip)
        nbytes = e.nbytes
        self._alive += nbytes
        self._conn.poll(0)  # free the slots of finished requests
        off = self._alloc(nbytes)
        self._peak = max(self._peak, self._alive + self._ring.used)
        slot = self._ring.segment.tensor(off, p.dtype, p.shape)
        with torch.no_grad():
            slot.copy_(grad)
        if owned:
            p.grad = None
        elif clip is not None:
            # The caller's gradient stays untouched: clip the copy, as clip_grad_norm_([p], c) would.
            saved, p.grad = p.grad, slot
            try:
                torch.nn.utils.clip_grad_norm_([p], clip)
            finally:
                p.grad = saved
        del grad
        self._alive -= nbytes
        return Staged(self._ring_seg, off, off)

    def _alloc(self, nbytes: int) -> int:
        while True:
            off = self._ring.try_alloc(nbytes)
            if off is not None:
                return off
            if not self._make_room():
                raise SonarError(f"a gradient of {nbytes} bytes does not fit the {self._ring.capacity}-byte ring")

    def _release(self, token: Any) -> None:
        self._ring.free(token)

    def _open_transfer(self, amsgrad: bool) -> Transfer:
        return ShmTransfer(self._conn, self._experts, amsgrad)

    def _memory_stats(self) -> dict[str, int]:
        return {"ring_bytes": self._ring.capacity if self._ring is not None else 0,
                "param_segment_bytes": sum(seg.size for seg in self._params)}


class ShmTransfer(Transfer):
    """One shared segment with room for the three states of the largest expert tensor."""

    def __init__(self, conn: Connection, experts: Mapping[int, Expert], amsgrad: bool) -> None:
        super().__init__(conn, experts, amsgrad)
        biggest = max(e.nbytes for e in experts.values())
        self._seg = Segment(3 * (-(-biggest // PAGE) * PAGE + PAGE), "xfer")
        self._seg_id = attach(conn, self._seg)
        self._stride = self._seg.size // 3

    def _offset(self, i: int) -> int:
        return i * self._stride + 1024 * (i + 1)  # staggered: no 4K aliasing between the states

    def _views(self, e: Expert) -> list[torch.Tensor]:
        return [self._seg.tensor(self._offset(i), e.param.dtype, e.param.shape) for i in range(self._n)]

    def _refs(self, e: Expert, part: int) -> list[MemRef]:
        refs = [{"seg": self._seg_id, "off": self._offset(i) + part * e.part_bytes, "nbytes": e.part_bytes}
                for i in range(3)]
        if self._n < 3:
            refs[2] = no_ref()
        return refs

    def close(self) -> None:
        self._conn.call("detach", {"seg": self._seg_id})
        self._seg.mm.close()
