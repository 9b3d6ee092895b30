"""The shared-memory path: CPU expert tensors, updated by sonard's CPU kernels.

The parameters move into one POSIX shared-memory segment for good (each at a page
boundary). Autograd allocates gradients in private memory. Where sonard can read this
process's memory (``_direct``: zero copy, the default when it can), each gradient stays
where it is, held until the server has answered the request that read it; otherwise it is
copied into a slot of a ring and freed at once, and the slot is given back with the reply.
Either way at most ``ring_layers`` of the largest layer of gradient bytes wait for the server
(``ring_layers=0``: a hook that sends a request waits for its reply).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._backend import Counter, BackendOptions, Expert, MemRef, ServerBackend, Staged, Transfer, no_ref, say_hello
from ._connection import Connection, SonarError, SonarRefused, is_local
from ._direct import attach_process
from ._dtensor import adopt, is_dtensor
from ._cpus import usable_cores
from ._openmp import choose_waiter
from ._shm import PAGE, Ring, Segment
from ._sqrt import check_session_sqrt, needed_sqrt_lib

log = logging.getLogger("sonar_moe")


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
                "an ipc:// or unix:// sonard of this user on this host loads a client's library, a tcp:// one only those "
                "its operator trusts: use server=None (a private sonard), an ipc:// or unix:// server, a tcp:// sonard "
                f"started with --trusted-sqrt-lib {lib}, or bfloat16 expert tensors") from e
        if torch.float32 in dtypes:
            check_session_sqrt(str(rep.get("sqrt", "")))
        return rep

    def __init__(self, conn: Connection, hello: Mapping[str, Any], named: list[tuple[str, nn.Parameter]],
                 options: BackendOptions, counter: Counter, slices: Mapping[int, int] | None = None) -> None:
        super().__init__(conn, hello, named, options, counter, slices)
        # While the trainer waits for sonard, torch's idle OpenMP threads sleep instead of
        # spinning on the cores the update needs (_openmp).
        conn.waiter = choose_waiter(torch.get_num_threads())
        self._params: list[Segment] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (segment id, offset)
        self._views: dict[int, torch.Tensor] = {}  # id(param) -> its memory in the segment
        self._ring: Ring | None = None
        self._ring_seg = 0
        self._alive = 0
        self._budget = 0  # gradient bytes that may wait for the server (ring_layers of the largest layer)
        self._held = 0  # zero copy: bytes of gradients held for requests in flight
        self._process_seg: int | None = None
        self.zero_copy_refused = ""  # why the server cannot read our gradients ("" when it can, or not asked)
        if options.zero_copy is not False:
            self._process_seg, self.zero_copy_refused = attach_process(conn, int(hello.get("pid") or 0))
            if self._process_seg is None:
                if options.zero_copy:
                    raise SonarError(f"zero_copy=True, but sonard cannot read this process's memory: {self.zero_copy_refused}")
                log.info("sonard cannot read this process's memory (%s): expert gradients are copied through "
                         "a shared-memory ring", self.zero_copy_refused)
        self._place(list(self._experts.values()))

    def default_ring_layers(self, conn: Connection) -> int:
        """Measured (docs/benchmarks.md, "How many gradients wait"): where torch's threads
        already take every core this process may use and the server runs on the same machine
        (ipc://, unix://), the server's work cannot overlap backward, only compete with it; each hook
        then waits for its own update (0), for about 3% of step time and a layer of gradients
        less at the peak. With a core to spare, or a server elsewhere, one layer waits (1) and the updates
        overlap backward."""
        local = is_local(conn.address)
        return 0 if local and torch.get_num_threads() >= usable_cores() else 1

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
            t = e.tensor
            if not t.is_contiguous():
                log.warning("expert tensor %s (strides %s) is made contiguous in shared memory: its values are "
                            "kept, but torch's matmuls over it may round differently", e.name, t.stride())
            view = seg.tensor(o, t.dtype, t.shape)
            with torch.no_grad():
                view.copy_(t)
            if is_dtensor(e.param):
                adopt(self._options.module, e.name, e.param, view)
            else:
                e.param.data = view
            self._where[id(e.param)] = (seg_id, o)
            self._views[id(e.param)] = view
        self._budget = self._ring_layers_bytes(lambda nbytes: nbytes)
        if self._ring is not None or self._process_seg is None:  # zero copy makes the ring when first needed
            self._ring_for(self._budget)

    def _ring_layers_bytes(self, size: Callable[[int], int]) -> int:
        """ring_layers (at least one) times the largest layer, each expert tensor counted as
        size(its bytes)."""
        layer: dict[str, int] = {}
        for e in self._experts.values():
            layer[e.key] = layer.get(e.key, 0) + size(e.nbytes)
        # ring_layers=0 waits for each request it sends, but a layer's expert tensors are sent as
        # one request once each has its gradient: one layer may still be gathering.
        return max(layer.values()) * max(self._options.ring_layers or 0, 1)

    def _ring_for(self, nbytes: int) -> Ring:
        """The gradient ring, made (or made larger) to take `nbytes` of gradients of the
        largest layer; only while no gradient is in the ring."""
        need = max(self._ring_layers_bytes(Ring.slot_bytes), Ring.slot_bytes(nbytes))
        if self._ring is None or self._ring.capacity < need:
            if self._ring is not None:
                if len(self._ring):
                    return self._ring  # gradients in flight: the ring grows when they are answered
                self._conn.call("detach", {"seg": self._ring_seg})  # the mapping goes with the last view
            self._ring = Ring(need, "ring")
            self._ring_seg = attach(self._conn, self._ring.segment)
        return self._ring

    def reclaim(self, param: nn.Parameter) -> bool:
        view = self._views.get(id(param))
        if view is None or is_dtensor(param) or param.data_ptr() == view.data_ptr():
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
        """Hold the gradient where it is for the server to read (zero copy), or copy it into a
        ring slot (freeing the original when owned)."""
        p, clip = e.param, self._options.max_expert_grad_norm
        if clip is not None and owned:
            # Per-tensor clipping, exactly clip_grad_norm_([p], c): NOT global-norm clipping.
            torch.nn.utils.clip_grad_norm_([p], clip)
        nbytes = e.nbytes
        if self._conn.in_flight:
            self._conn.poll(0)  # give back what finished requests held
        if owned and self._process_seg is not None and self._readable(grad, e.tensor):
            while self._held and self._held + nbytes > self._budget:
                if not self._make_room():
                    break
            p.grad = None
            self._held += nbytes
            self._peak = max(self._peak, self._held + (self._ring.used if self._ring is not None else 0))
            return Staged(self._process_seg, grad.data_ptr(), Held(grad, nbytes))
        self._alive += nbytes
        off = self._alloc(nbytes)
        ring = self._ring
        assert ring is not None
        self._peak = max(self._peak, self._alive + ring.used + self._held)
        t = e.tensor
        slot = ring.segment.tensor(off, t.dtype, t.shape)
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

    @staticmethod
    def _readable(grad: torch.Tensor, p: torch.Tensor) -> bool:
        """A gradient the server can read in place: dense, contiguous, the parameter's dtype
        and size, in this process's memory (``is_cpu``: ``device.type`` builds a device object, 1 us
        of every gradient hook)."""
        return (grad.is_cpu and grad.layout == torch.strided and grad.dtype == p.dtype
                and grad.numel() == p.numel() and grad.is_contiguous() and grad.data_ptr() != 0)

    def _alloc(self, nbytes: int) -> int:
        ring = self._ring_for(nbytes) if self._ring is None or not len(self._ring) else self._ring
        while True:
            off = ring.try_alloc(nbytes)
            if off is not None:
                return off
            if not self._make_room():
                raise SonarError(f"a gradient of {nbytes} bytes does not fit the {ring.capacity}-byte ring")
            if not len(ring):
                ring = self._ring_for(nbytes)

    def _release(self, token: Any) -> None:
        if isinstance(token, Held):
            self._held -= token.nbytes
            token.grad = None  # the server has read it: autograd's memory goes back to torch
        else:
            assert self._ring is not None
            self._ring.free(token)

    def _open_transfer(self, amsgrad: bool) -> Transfer:
        return ShmTransfer(self._conn, self._experts, amsgrad)

    def _memory_stats(self) -> dict[str, int]:
        return {"ring_bytes": self._ring.capacity if self._ring is not None else 0,
                "param_segment_bytes": sum(seg.size for seg in self._params),
                "zero_copy": self._process_seg is not None, "held_grad_bytes": self._held}


class Held:
    """A gradient the server reads in place; dropped when the request's reply arrives."""

    __slots__ = ("grad", "nbytes")

    def __init__(self, grad: torch.Tensor | None, nbytes: int) -> None:
        self.grad, self.nbytes = grad, nbytes


class ShmTransfer(Transfer):
    """A shared segment for the states of a batch of tensors. A tensor of a page or more
    has its states a page apart and staggered by 1 KiB (no 4K aliasing between them);
    smaller ones are packed 64 bytes apart."""

    def __init__(self, conn: Connection, experts: Mapping[int, Expert], amsgrad: bool) -> None:
        super().__init__(conn, experts, amsgrad)
        self._seg: Segment | None = None
        self._seg_id = 0
        self._used = 0

    @staticmethod
    def _layout(e: Expert) -> tuple[int, int, int]:
        """Where e's states go in its slot: the slot's alignment, the bytes from one state to
        the next, and how far each further state is staggered."""
        nbytes = e.nbytes
        if nbytes >= PAGE:
            return PAGE, -(-nbytes // PAGE) * PAGE + PAGE, 1024
        return 64, -(-nbytes // 64) * 64, 0

    def _begin(self, es: list[Expert]) -> None:
        need = [self._n * stride + align for align, stride, _ in map(self._layout, es)]  # with the most alignment adds
        size = max(max(need), min(self.BATCH_BYTES, sum(need)))
        if self._seg is None or self._seg.size < size:
            self.close()
            seg = Segment(-(-size // PAGE) * PAGE, "xfer")
            try:
                self._seg_id = attach(self._conn, seg)
            except BaseException:
                seg.mm.close()
                raise
            self._seg = seg
        self._used = 0

    def _slot(self, e: Expert) -> list[int] | None:
        """The offsets of e's states."""
        assert self._seg is not None
        align, stride, stagger = self._layout(e)
        base = -(-self._used // align) * align
        end = base + self._n * stride
        if self._used and end > self._seg.size:
            return None
        self._used = end
        return [base + i * stride + stagger * (i + 1) for i in range(self._n)]

    def _views(self, e: Expert, slot: Any) -> list[torch.Tensor]:
        assert self._seg is not None
        t = e.tensor
        return [self._seg.tensor(off, t.dtype, t.shape) for off in slot]

    def _refs(self, e: Expert, slot: Any, part: int) -> list[MemRef]:
        nbytes = e.part_bytes
        refs = [{"seg": self._seg_id, "off": off + part * nbytes, "nbytes": nbytes} for off in slot]
        return refs + [no_ref() for _ in range(3 - self._n)]

    def _reset(self) -> None:
        self._used = 0

    def close(self) -> None:
        seg, self._seg = self._seg, None
        if seg is not None:
            try:
                self._conn.call("detach", {"seg": self._seg_id})
            finally:
                seg.mm.close()
