"""SonarAdamW: torch.optim.AdamW with the expert tensors updated by sonard during backward."""

from __future__ import annotations

import functools
import logging
import os
import statistics
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _cuda
from ._client import Connection, SonarError, start_private_server, torch_sqrt_is_ieee, torch_sqrt_library
from ._detect import group_key, is_expert_param
from ._shm import PAGE, Ring, Segment

log = logging.getLogger("sonar_moe")

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def torch_scalars(group: dict[str, Any], step: float) -> dict[str, Any]:
    """One step's AdamW constants, computed in Python float64 exactly as
    torch.optim.adam._single_tensor_adam computes them."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    return {
        "decay": 1 - lr * wd,
        "apply_decay": wd != 0,
        "beta1_w": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "neg_step_size": -step_size,
        "bc2_sqrt": bias_correction2_sqrt,
        "eps": float(group["eps"]),
        "amsgrad": bool(group["amsgrad"]),
        "maximize": bool(group["maximize"]),
    }


@dataclass
class _Expert:
    name: str
    param: nn.Parameter
    tids: list[int] = field(default_factory=list)  # one server tensor, or one per expert slice
    parts: int = 1
    key: str = ""
    offset: int = 0  # in the parameter segment
    micro: int = 0  # micro-batch gradients sent since the last apply

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    @property
    def part_bytes(self) -> int:
        return self.nbytes // self.parts


@dataclass
class _Group:
    size: int
    items: list[dict[str, Any]] = field(default_factory=list)
    slots: list[Any] = field(default_factory=list)  # ring offsets, or CUDA gradient holders


class SonarAdamW(torch.optim.Optimizer):
    """AdamW whose expert tensors are updated by sonard the moment their gradient is final.

    Bit-for-bit equal to ``torch.optim.AdamW`` over all parameters (with
    ``max_grad_norm=c``: to ``clip_grad_norm_(dense_params, c)`` then AdamW).
    See the README for usage and limits.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[tuple[str, nn.Parameter]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        expert_params: Callable[[str, torch.Tensor], bool] | None = None,
        server: str | None = None,
        grad_accumulation_steps: int = 1,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        max_expert_grad_norm: float | None = None,
        split_experts: bool = False,
        nonfinite: str = "propagate",
        timeout: float = 10.0,
        ring_layers: int = 1,
        namespace: str | None = None,
    ) -> None:
        named = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
        seen: set[int] = set()
        params: list[tuple[str, nn.Parameter]] = []
        for name, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((name, p))
        if not params:
            raise ValueError("SonarAdamW got no trainable parameters")
        if grad_accumulation_steps < 1:
            raise ValueError(f"grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if max_expert_grad_norm is not None:
            if not max_expert_grad_norm > 0:
                raise ValueError(f"max_expert_grad_norm must be positive or None, got {max_expert_grad_norm}")
            if grad_accumulation_steps > 1:
                raise ValueError("max_expert_grad_norm clips each expert tensor's gradient as it arrives, which with "
                                 "grad_accumulation_steps > 1 would clip micro-batches, not their sum: not supported")
        if nonfinite not in ("propagate", "skip"):
            raise ValueError(f"nonfinite must be 'propagate' or 'skip', got {nonfinite!r}")
        if ring_layers < 1:
            raise ValueError(f"ring_layers must be >= 1, got {ring_layers}")
        pred = expert_params or is_expert_param
        self._experts: dict[int, _Expert] = {}
        dense: list[nn.Parameter] = []
        for name, p in params:
            if pred(name, p):
                self._check_expert(name, p)
                self._experts[id(p)] = _Expert(name, p, key=group_key(name))
            else:
                dense.append(p)
        # Dense parameters keep standard AdamW; its defaults are this optimizer's defaults.
        self._dense_params = dense
        self._dense = torch.optim.AdamW(
            dense or [nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        )
        super().__init__([p for _, p in params], dict(self._dense.defaults))
        self.max_grad_norm = max_grad_norm
        self.max_expert_grad_norm = max_expert_grad_norm
        # split_experts: one server tensor and one request per expert slice of a batched tensor.
        # Same updates, more requests: the per-expert baseline of the benchmarks.
        self.split_experts = split_experts
        # nonfinite="propagate": NaN/Inf gradients update as in torch (the parameter becomes NaN).
        # "skip": a tensor whose gradient is not finite is not updated (nor its step advanced);
        # the dense step is skipped when any dense gradient is not finite.
        self.nonfinite = nonfinite
        self.grad_accumulation_steps = grad_accumulation_steps
        # namespace: a label for this client (e.g. "rank3" when several ranks share one sonard),
        # sent in hello (servers ignore keys they do not know), shown in logs and stats().
        # Isolation itself needs no label: tensors and segments belong to the connection.
        self.namespace = namespace
        self.last_dense_grad_norm: torch.Tensor | None = None
        self._timeout = timeout
        self._errors: list[str] = []
        self._alive = 0
        self._peak = 0
        self._closed = False
        self._conn: Connection | None = None
        self._param_seg: Segment | None = None
        self._ring: Ring | None = None
        self._cuda: _cuda.CudaExperts | None = None  # CUDA expert tensors (docs/gpu.md)
        self._cuda_xfer: list[Any] = []  # CUDA state buffers of a state_dict transfer
        self._groups: dict[str, _Group] = {}
        self._hooks: list[Any] = []
        self._counts = {"step_requests": 0, "grads_sent": 0, "bytes_sent": 0, "skipped_nonfinite": 0}
        if self._experts:
            self._start(server, ring_layers)

    @staticmethod
    def _check_expert(name: str, p: torch.Tensor) -> None:
        if p.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"expert tensor {name} is on {p.device}: only CPU and CUDA tensors are supported")
        if p.device.type == "cuda" and not p.is_contiguous():
            raise ValueError(f"CUDA expert tensor {name} is not contiguous")
        if p.dtype not in _DTYPES:
            raise TypeError(f"expert tensor {name} has dtype {p.dtype}: float32 and bfloat16 are supported")
        if not p.is_leaf:
            raise ValueError(f"expert tensor {name} is not a leaf tensor")

    # ----------------------------------------------------------------- set-up
    def _start(self, server: str | None, ring_layers: int) -> None:
        self._conn = start_private_server(self._timeout) if server is None else Connection(server, self._timeout)
        self._finalizer = weakref.finalize(self, _shutdown, self._conn)
        hello = {
            "client": "sonar_moe", "pid": os.getpid(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
        }
        if self.namespace is not None:
            hello["namespace"] = str(self.namespace)
        rep = self._conn.call("hello", hello, timeout=max(self._timeout, 10.0))
        log.info("connected to sonard %s (protocol %s, pid %s, sqrt %s, namespace %s)", rep.get("server"),
                 rep.get("protocol"), rep.get("pid"), rep.get("sqrt"), self.namespace)
        experts = list(self._experts.values())
        devices = {e.param.device for e in experts}
        if any(d.type == "cuda" for d in devices):
            self._start_cuda(experts, rep, devices)
            return
        self._check_sqrt(str(rep.get("sqrt", "")))
        # Parameters move into one shared segment for good, each at a page boundary.
        off = 0
        for e in experts:
            e.offset = off
            off += -(-e.nbytes // PAGE) * PAGE
        self._param_seg = Segment(off, "params")
        try:
            seg = self._attach(self._param_seg)
        finally:
            self._param_seg.unlink()
        for e in experts:
            view = self._param_seg.tensor(e.offset, e.param.dtype, e.param.shape)
            with torch.no_grad():
                view.copy_(e.param)
            e.param.data = view
        self._register(experts, lambda e: (seg, e.offset))
        # The gradient ring holds ring_layers of the largest layer's expert gradients.
        layer: dict[str, int] = {}
        for e in experts:  # batched tensors of one layer share the module prefix
            lk = e.key.rsplit("experts", 1)[0]
            layer[lk] = layer.get(lk, 0) + Ring.slot_bytes(e.nbytes)
        self._ring = Ring(max(layer.values()) * ring_layers, "ring")
        try:
            self._ring_seg = self._attach(self._ring.segment)
        finally:
            self._ring.segment.unlink()

    def _start_cuda(self, experts: list[_Expert], hello: dict[str, Any], devices: set[torch.device]) -> None:
        """CUDA experts: registered in place by IPC handle; no shared memory, no ring."""
        assert self._conn is not None
        self._cuda = _cuda.start(self._conn, hello, devices)
        log.info("sonard updates the expert tensors on %s (%s)", next(iter(devices)), hello.get("cuda"))

        def ref(e: _Expert) -> tuple[int, int]:
            r = self._cuda.param_ref(e.param)
            return r["seg"], r["off"]

        self._register(experts, ref)

    def _register(self, experts: list[_Expert], where: Callable[[_Expert], tuple[int, int]]) -> None:
        """Register the expert tensors (one per expert slice with split_experts) whose memory
        starts at where(e) = (segment id, offset), group them, and hook them."""
        assert self._conn is not None
        g = self.param_groups[0]
        hyper = {"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
                 "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]),
                 "amsgrad": bool(g["amsgrad"]), "maximize": bool(g["maximize"])}
        specs = []
        for e in experts:
            if self.split_experts and e.param.dim() >= 3:
                e.parts = e.param.shape[0]
            shape = list(e.param.shape[1:]) if e.parts > 1 else list(e.param.shape)
            seg, off = where(e)
            for i in range(e.parts):
                specs.append({"name": e.name if e.parts == 1 else f"{e.name}.{i}", "shape": shape,
                              "dtype": _DTYPES[e.param.dtype], "hyper": hyper,
                              "param": {"seg": seg, "off": off + i * e.part_bytes, "nbytes": e.part_bytes}})
        ids = iter(self._conn.call("register", {"tensors": specs})["ids"])
        for e in experts:
            e.tids = [next(ids) for _ in range(e.parts)]
            self._groups.setdefault(e.key, _Group(0)).size += 1
            self.state[e.param]["step"] = torch.tensor(0.0, dtype=torch.float32)
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._on_grad))

    @staticmethod
    def _check_sqrt(server_sqrt: str) -> None:
        """The server must compute float32 sqrt as this process's torch does."""
        lib = torch_sqrt_library()
        if lib is None:
            if server_sqrt != "ieee":
                log.warning("sonard uses %s for float32 sqrt but this torch does not: updates may differ in the last bit", server_sqrt)
            elif not torch_sqrt_is_ieee():
                log.warning("this torch's float32 sqrt is neither IEEE nor MKL vmsSqrt: updates may differ in the last bit")
            return
        if server_sqrt == "ieee":
            raise SonarError(
                "this torch computes float32 sqrt with MKL's vmsSqrt, but sonard uses the IEEE sqrt: start it with "
                f"`sonard --torch-lib {lib}` (or SONAR_TORCH_LIB) for bit-for-bit equality with torch.optim.AdamW")
        if os.path.realpath(server_sqrt.removeprefix("mkl:")) != os.path.realpath(lib):
            log.warning("sonard's float32 sqrt comes from %s, this torch's from %s", server_sqrt, lib)

    def _attach(self, seg: Segment) -> int:
        assert self._conn is not None
        return int(self._conn.call("attach", {"shm": seg.name, "size": seg.size})["seg"])

    # --------------------------------------------------------------- backward
    def _on_grad(self, p: torch.Tensor) -> None:
        """post-accumulate-grad hook: copy the gradient into a slot, free it, send the layer."""
        if p.grad is None or self._conn is None or (self._ring is None and self._cuda is None):
            return
        self._hand_over(p, p.grad, owned=True)  # no local reference: _hand_over frees it

    def remove_grad_hooks(self) -> None:
        """Stop taking expert gradients from the post-accumulate-grad hooks.

        For callers that produce the final gradient elsewhere (e.g. after a data-parallel
        all-reduce, see ``sonar_moe.distributed``) and pass it to :meth:`hand_over_grad`.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def hand_over_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply ``grad`` as this step's gradient of expert tensor ``param`` (one micro-batch).

        As the post-accumulate-grad hook does, but with a gradient the caller owns: it is
        copied into a slot of the ring and sent; ``grad`` and ``param.grad`` are left alone
        (the caller frees them). Exactly the update the hook would make for ``param.grad = grad``.
        """
        e = self._experts.get(id(param))
        if e is None:
            raise ValueError("hand_over_grad: not an expert parameter of this optimizer")
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            raise ValueError(f"hand_over_grad: gradient {tuple(grad.shape)} {grad.dtype} {grad.device} does not "
                             f"match {e.name} {tuple(param.shape)} {param.dtype} {param.device}")
        self._hand_over(param, grad, owned=False)

    def _hand_over(self, p: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
        """Hand one expert gradient to the server. owned: grad is p.grad, freed here."""
        if self._closed:
            raise SonarError("SonarAdamW is closed")
        e = self._experts[id(p)]
        if self.nonfinite == "skip" and not bool(torch.isfinite(grad).all()):
            if owned:
                p.grad = None
            self._counts["skipped_nonfinite"] += 1
            log.warning("skipping the update of %s: its gradient is not finite", e.name)
            return
        if self._cuda is not None:
            self._hand_over_cuda(e, p, grad, owned)
        else:
            self._hand_over_shm(e, p, grad, owned)

    def _hand_over_shm(self, e: _Expert, p: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
        """CPU: copy the gradient into a ring slot (freeing the original when owned) and queue it."""
        assert self._conn is not None and self._ring is not None
        if self.max_expert_grad_norm is not None and owned:
            # Per-tensor clipping, exactly clip_grad_norm_([p], c): NOT global-norm clipping.
            torch.nn.utils.clip_grad_norm_([p], self.max_expert_grad_norm)
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
        elif self.max_expert_grad_norm is not None:
            # The caller's gradient stays untouched: clip the copy, as clip_grad_norm_([p], c) would.
            saved, p.grad = p.grad, slot
            try:
                torch.nn.utils.clip_grad_norm_([p], self.max_expert_grad_norm)
            finally:
                p.grad = saved
        del grad
        self._alive -= nbytes
        self._queue(e, self._ring_seg, off, off)

    def _queue(self, e: _Expert, seg: int, off: int, release: Any) -> None:
        """Queue the step of e's gradient at (seg, off): one request per expert slice with
        split_experts, else one per layer group. `release` (a ring offset, or a CUDA gradient
        holder) is given back when the request that used it last is answered."""
        e.micro += 1
        apply = e.micro >= self.grad_accumulation_steps
        step, scalars = self._next_step(e) if apply else (0, {})
        items = [{"tensor": tid, "grad": {"seg": seg, "off": off + i * e.part_bytes, "nbytes": e.part_bytes},
                  "apply": apply, "step": step, "scalars": scalars} for i, tid in enumerate(e.tids)]
        if e.parts > 1:
            for i, it in enumerate(items):
                self._send_items([it], [release] if i == len(items) - 1 else [])
            return
        item = items[0]
        grp = self._groups[e.key]
        if any(i["tensor"] == item["tensor"] for i in grp.items):
            self._send(grp)  # an earlier backward left this layer incomplete (experts without tokens)
        grp.items.append(item)
        grp.slots.append(release)
        if len(grp.items) >= grp.size:
            self._send(grp)

    def _hand_over_cuda(self, e: _Expert, p: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
        """CUDA: share the gradient by handle, record the event, queue; keep it until the reply."""
        assert self._conn is not None and self._cuda is not None
        if self.max_expert_grad_norm is not None:
            # Per-tensor clipping, exactly clip_grad_norm_([p], c); a caller's gradient stays untouched.
            if not owned:
                grad = grad.clone()
            saved, p.grad = p.grad, grad
            try:
                torch.nn.utils.clip_grad_norm_([p], self.max_expert_grad_norm)
            finally:
                p.grad = saved
        if owned:
            p.grad = None
        self._conn.poll(0)  # release the gradients of finished requests
        ref, holder = self._cuda.grad_ref(grad.contiguous())
        del grad
        self._cuda.record()
        self._queue(e, ref["seg"], ref["off"], holder)

    def _next_step(self, e: _Expert) -> tuple[int, dict[str, Any]]:
        step_t = self.state[e.param]["step"]
        step_t += 1
        step = step_t.item()
        e.micro = 0
        return int(step), torch_scalars(self.param_groups[0], step)

    def _send(self, grp: _Group) -> None:
        items, slots = grp.items, grp.slots
        grp.items, grp.slots = [], []
        self._send_items(items, slots)

    def _send_items(self, items: list[dict[str, Any]], slots: list[Any]) -> None:
        assert self._conn is not None
        self._counts["step_requests"] += 1
        self._counts["grads_sent"] += sum(1 for i in items if i["grad"]["seg"])
        self._counts["bytes_sent"] += sum(i["grad"]["nbytes"] for i in items if i["grad"]["seg"])
        body: dict[str, Any] = {"items": items}
        if self._cuda is not None:
            body["wait_event"] = True
        self._conn.send("step", body, functools.partial(self._on_step_reply, slots))

    def _on_step_reply(self, slots: list[Any], rep: dict[str, Any]) -> None:
        if self._cuda is not None:  # CUDA: slots are the gradients kept alive until now
            for holder in slots:
                self._cuda.release(holder)
        else:
            assert self._ring is not None
            for off in slots:
                self._ring.free(off)
        if not rep.get("ok"):
            self._errors.append(str(rep.get("error")))

    def _alloc(self, nbytes: int) -> int:
        assert self._ring is not None and self._conn is not None
        while True:
            off = self._ring.try_alloc(nbytes)
            if off is not None:
                return off
            if self._conn.in_flight:
                self._conn.wait_any()
            elif any(g.items for g in self._groups.values()):
                for g in self._groups.values():
                    if g.items:
                        self._send(g)  # a layer whose other experts got no gradient
            else:
                raise SonarError(f"a gradient of {nbytes} bytes does not fit the {self._ring.capacity}-byte ring")

    def _drain(self) -> None:
        """Send what is pending, apply accumulated gradients, and wait for every reply."""
        if self._conn is None:
            return
        for g in self._groups.values():
            if g.items:
                self._send(g)
        leftovers = [e for e in self._experts.values() if e.micro > 0]
        if leftovers:  # tensors that missed some of this step's micro-batches
            items = []
            for e in leftovers:
                step, sc = self._next_step(e)
                items += [{"tensor": tid, "grad": {"seg": 0, "off": 0, "nbytes": 0},
                           "apply": True, "step": step, "scalars": sc} for tid in e.tids]
            body: dict[str, Any] = {"items": items}
            if self._cuda is not None:
                body["wait_event"] = True
            self._conn.send("step", body, functools.partial(self._on_step_reply, []))
        self._conn.wait()
        if self._errors:
            errs, self._errors = self._errors, []
            raise SonarError("sonard could not apply expert updates: " + "; ".join(errs))

    # ------------------------------------------------------------ optimizer
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Wait for the expert updates, clip the dense gradients, step dense AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise SonarError("SonarAdamW is closed")
        self._drain()
        if self._dense_params:
            dg = self._dense.param_groups[0]
            for k, v in self.param_groups[0].items():
                if k != "params":
                    dg[k] = v
            if self.nonfinite == "skip" and not all(
                    bool(torch.isfinite(p.grad).all()) for p in self._dense_params if p.grad is not None):
                self._counts["skipped_nonfinite"] += 1
                log.warning("skipping the dense step: a dense gradient is not finite")
                return loss
            if self.max_grad_norm is not None:
                self.last_dense_grad_norm = torch.nn.utils.clip_grad_norm_(self._dense_params, self.max_grad_norm)
            self._dense.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's state_dict format, expert state fetched from the server."""
        self._drain()
        for p in self._dense_params:
            if p in self._dense.state:
                self.state[p] = self._dense.state[p]
        xfer = self._xfer_segment()
        try:
            for e in self._experts.values():
                st = self.state[e.param]
                if st["step"].item() == 0:
                    continue
                views = self._xfer_views(xfer, e)
                assert self._conn is not None
                for i in range(e.parts):
                    self._conn.call("export", self._xfer_body(xfer, e, 0, i))
                st["exp_avg"] = views[0].clone()
                st["exp_avg_sq"] = views[1].clone()
                if self.param_groups[0]["amsgrad"]:
                    st["max_exp_avg_sq"] = views[2].clone()
            sd = super().state_dict()
        finally:
            self._release_xfer(xfer)
            for e in self._experts.values():  # the server keeps the state; sd keeps the copies
                self.state[e.param] = {"step": self.state[e.param]["step"]}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of SonarAdamW or torch.optim.AdamW; expert state goes to the server."""
        self._drain()
        super().load_state_dict(state_dict)
        for p in self._dense_params:
            if p in self.state:
                self._dense.state[p] = self.state[p]
        xfer = self._xfer_segment()
        try:
            for e in self._experts.values():
                st = self.state[e.param]
                step_t = st.get("step")
                step_t = torch.tensor(0.0) if step_t is None else step_t.detach().to(torch.float32).cpu().clone()
                views = self._xfer_views(xfer, e)
                for i, k in enumerate(("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: len(views)]):
                    src = st.get(k)
                    if src is None:
                        views[i].zero_()
                    elif src.shape != e.param.shape:
                        raise ValueError(f"state {k} of {e.name} has shape {tuple(src.shape)}, want {tuple(e.param.shape)}")
                    else:
                        views[i].copy_(src)
                assert self._conn is not None
                for i in range(e.parts):
                    self._conn.call("import", self._xfer_body(xfer, e, int(step_t.item()), i))
                self.state[e.param] = {"step": step_t}
        finally:
            self._release_xfer(xfer)

    def _xfer_segment(self) -> tuple[Segment, int] | None:
        if not self._experts or self._conn is None or self._cuda is not None:
            return None  # CUDA: state moves through CUDA buffers (_xfer_views)
        biggest = max(e.nbytes for e in self._experts.values())
        seg = Segment(3 * (-(-biggest // PAGE) * PAGE + PAGE), "xfer")
        try:
            return seg, self._attach(seg)
        finally:
            seg.unlink()

    def _xfer_views(self, xfer: tuple[Segment, int] | None, e: _Expert) -> list[torch.Tensor]:
        n = 3 if self.param_groups[0]["amsgrad"] else 2
        if self._cuda is not None:  # CUDA buffers shared by handle, kept until the next call or the end
            self._release_cuda_xfer()
            views = [torch.zeros_like(e.param, memory_format=torch.contiguous_format) for _ in range(n)]
            self._cuda_xfer = [self._cuda.grad_ref(v) for v in views]
            return views
        assert xfer is not None
        stride = xfer[0].size // 3
        return [xfer[0].tensor(i * stride + 1024 * (i + 1), e.param.dtype, e.param.shape) for i in range(n)]

    def _xfer_body(self, xfer: tuple[Segment, int] | None, e: _Expert, step: int, part: int) -> dict[str, Any]:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda.device)  # the buffers' writes are done before the server copies
            crefs = [{**r, "off": r["off"] + part * e.part_bytes, "nbytes": e.part_bytes} for r, _ in self._cuda_xfer]
            crefs += [{"seg": 0, "off": 0, "nbytes": 0}] * (3 - len(crefs))
            return {"tensor": e.tids[part], "step": step, "exp_avg": crefs[0], "exp_avg_sq": crefs[1],
                    "max_exp_avg_sq": crefs[2]}
        assert xfer is not None
        stride = xfer[0].size // 3
        refs = [{"seg": xfer[1], "off": i * stride + 1024 * (i + 1) + part * e.part_bytes, "nbytes": e.part_bytes}
                for i in range(3)]
        if not self.param_groups[0]["amsgrad"]:
            refs[2] = {"seg": 0, "off": 0, "nbytes": 0}
        return {"tensor": e.tids[part], "step": step, "exp_avg": refs[0], "exp_avg_sq": refs[1], "max_exp_avg_sq": refs[2]}

    def _release_cuda_xfer(self) -> None:
        held, self._cuda_xfer = self._cuda_xfer, []
        if self._cuda is not None:
            for _, holder in held:
                self._cuda.release(holder)

    def _release_xfer(self, xfer: tuple[Segment, int] | None) -> None:
        self._release_cuda_xfer()
        if xfer is None or self._conn is None:
            return
        self._conn.call("detach", {"seg": xfer[1]})
        xfer[0].mm.close()

    # ------------------------------------------------------------ reporting
    def stats(self, server: bool = True) -> dict[str, Any]:
        """Client figures (peak expert-gradient bytes, requests, latencies) and, with server=True,
        the server's counters."""
        lat = sorted(self._conn.latencies) if self._conn else []
        out: dict[str, Any] = {
            "peak_expert_grad_bytes": self._peak,
            "ring_bytes": self._ring.capacity if self._ring is not None else 0,
            "namespace": self.namespace,
            "expert_tensors": len(self._experts),
            "dense_tensors": len(self._dense_params),
            **self._counts,
            "requests": len(lat),
            "latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else 0.0,
            "latency_ms_p99": 1e3 * lat[min(len(lat) - 1, len(lat) * 99 // 100)] if lat else 0.0,
            "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else 0.0,
        }
        if server and self._conn is not None and not self._closed:
            out["server"] = self._conn.call("stats", {})
        return out

    def reset_peak(self) -> None:
        """Start a new peak measurement of expert-gradient bytes."""
        self._peak = 0

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for outstanding updates, stop a private server (or leave a shared one)."""
        if self._closed:
            return
        try:
            if self._conn is not None and self._conn.in_flight:
                self._drain()
        finally:
            self._closed = True
            for h in self._hooks:
                h.remove()
            if self._conn is not None:
                self._finalizer()
            if self._cuda is not None:
                self._cuda.close()

    def __enter__(self) -> SonarAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(conn: Connection) -> None:
    """Say goodbye (a private server shuts down) and close the socket; best effort at exit."""
    try:
        conn.shutdown()
    except Exception as e:  # noqa: BLE001
        log.warning("sonard did not acknowledge the goodbye: %s", e)
