"""Expert backends: how one SonarAdamW's expert tensors reach sonard and are updated there.

One interface (:class:`ExpertBackend`), one implementation per memory path, chosen once when
the optimizer starts (``SonarAdamW`` never asks again which path it is on):

* :class:`~._shm_backend.ShmBackend`: CPU tensors. Parameters live in a POSIX shared-memory
  segment; each gradient is copied into a slot of a ring the server maps.
* :class:`~._cuda_backend.CudaBackend`: CUDA tensors, registered in place by IPC handle; each
  gradient is shared by handle and ordered by an interprocess event.
* :class:`NoExperts`: no expert tensor, no server.

:class:`ServerBackend` holds what both server paths share (the session, registration, step
requests per layer, gradient accumulation, waiting, the state-transfer loops, figures); a
path supplies where memory is (``_param_ref``), how a gradient is staged (``_stage``) and
released (``_release``), and its state-transfer buffers (``_open_transfer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from ._clipping import ExpertClipper
from ._connection import MAX_ITEMS, Connection, RequestTrace, SonarError, SonarRefused, in_requests
from ._detect import group_key
from ._dtensor import is_dtensor, like, local, local_state
from ._launch import connect
from ._steps import StepQueue

log = logging.getLogger("sonar_moe")

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MemRef = dict[str, int]
# Advance an expert tensor's step counter: (step, torch_scalars of that step).
Advance = Callable[[nn.Parameter], tuple[int, dict[str, Any]]]
# Per expert tensor: the hyper-parameters the server checks at registration.
HyperOf = Callable[[nn.Parameter], Mapping[str, Any]]


class Counter(Protocol):
    """The optimizer's step counters of the expert tensors."""

    def advance(self, param: nn.Parameter) -> tuple[int, dict[str, Any]]:
        """Count the next step of `param`; that step and its torch_scalars."""
        ...

    def retreat(self, param: nn.Parameter, step: int) -> None:
        """The server refused step `step` of `param`: count it back."""
        ...


def no_ref() -> MemRef:
    """The MemRef meaning "no memory" (an apply without a gradient, an unused state)."""
    return {"seg": 0, "off": 0, "nbytes": 0}


@dataclass
class Expert:
    """One expert tensor and its server tensors (one, or one per expert slice)."""

    name: str
    param: nn.Parameter
    key: str  # the MoE block (group_key): its tensors go to the server in one request
    slices: int = 1  # experts stacked along dim 0 (split_experts makes one server tensor of each)
    parts: int = 1
    tids: list[int] = field(default_factory=list)
    micro: int = 0  # micro-batch gradients sent since the last apply
    # What the server was given at registration: a parameter moved or cast since
    # (share_memory(), .to()) is not the memory it updates.
    ptr: int = 0
    dtype: torch.dtype | None = None
    # Read in every gradient hook, so worked out once: whether the parameter is a DTensor (its
    # local shard is the memory) and the bytes of that memory (fixed: a parameter moved or
    # cast since registration is refused by check()).
    sharded: bool = field(init=False, default=False)
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.sharded = is_dtensor(self.param)
        t = self.tensor
        self.nbytes = t.numel() * t.element_size()

    @classmethod
    def of(cls, name: str, param: nn.Parameter, slices: Mapping[int, int] | None) -> Expert:
        """An expert tensor; ``slices`` (by id of the parameter) says how many experts it stacks,
        else a tensor of 3 or more dimensions stacks ``shape[0]``."""
        n = slices.get(id(param)) if slices is not None else None
        if n is None:
            n = param.shape[0] if param.dim() >= 3 else 1
        return cls(name, param, group_key(name), slices=n)

    @property
    def tensor(self) -> torch.Tensor:
        """The memory sonard updates: the parameter, or a DTensor parameter's local shard."""
        return local(self.param) if self.sharded else self.param

    @property
    def part_bytes(self) -> int:
        """The bytes of one server tensor (an expert slice with split_experts)."""
        return self.nbytes // self.parts


@dataclass(frozen=True)
class BackendOptions:
    """SonarAdamW's settings that concern the expert tensors."""

    timeout: float = 10.0
    split_experts: bool = False
    grad_accumulation_steps: int = 1
    max_expert_grad_norm: float | None = None
    # How many layers of expert gradients may wait for the server: 0, none beyond the request being
    # made (its hook waits for the reply); None: the path chooses (ServerBackend.default_ring_layers).
    ring_layers: int | None = None
    namespace: str | None = None
    # CPU: sonard reads each gradient where autograd left it (None: when it can, else through
    # the shared-memory ring; True: required; False: always the ring).
    zero_copy: bool | None = None
    # expert_clipping: the factor of each applied expert gradient and the sink of the norms the
    # server measures (None: the gradients go unscaled and unmeasured, the default path)
    clipper: ExpertClipper | None = None
    # The model the tensors belong to, where known: DTensor (FSDP2) expert tensors move into shared
    # memory through its load_state_dict hooks (sonar_moe/_dtensor.py).
    module: nn.Module | None = field(default=None, compare=False)


class Staged(NamedTuple):
    """A gradient the server can read at (seg, off); `token` is released after the reply."""

    seg: int
    off: int
    token: Any


class StateTransfer(Protocol):
    """Moves expert optimizer state between the server and the client (state_dict)."""

    def fetch(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) of `param`, as new tensors."""
        ...

    def fetch_all(self, params: list[nn.Parameter]) -> list[dict[str, torch.Tensor]]:
        """fetch() of each of params, in order, many requests in flight at once."""
        ...

    def store_all(self, items: list[tuple[nn.Parameter, int, Mapping[str, torch.Tensor | None]]],
                  stored: Callable[[nn.Parameter], None] | None = None) -> None:
        """Set each param's server state: `step` and the tensors of `state` (missing ones: zeros),
        shapes checked first; stored(param) after each one the server took, in order."""
        ...


class ExpertBackend(Protocol):
    """The expert tensors of one optimizer, updated by the server."""

    def hand_over(self, param: nn.Parameter, grad: torch.Tensor, owned: bool) -> None:
        """Queue one micro-batch gradient of expert `param`. owned: `grad` is `param.grad`, freed here."""
        ...

    def drain(self) -> None:
        """Send what is pending, apply accumulated gradients, wait for every reply."""
        ...

    def settle(self) -> None:
        """Send what is pending and wait for every reply, leaving accumulated micro-batches pending."""

    def pending(self) -> bool:
        """Whether micro-batches of a step not applied yet are summed on the server."""
        ...

    def abandon(self) -> None:
        """After settle(): drop the micro-batches accumulated for a step that will not come (the
        server's discard)."""
        ...

    def check(self, param: nn.Parameter) -> None:
        """Raise RuntimeError if `param` is no longer the memory the server updates."""
        ...

    def set_grad_accumulation_steps(self, k: int) -> None:
        """From now on apply AdamW at every k-th hand-over of a tensor (no micro-batch may be pending)."""
        ...

    def set_step_boundary(self, ends_step: bool | None) -> None:
        """Whether the coming hand-overs complete their tensors' step (True), are accumulated
        (False), or the k-th one since the last applied does (None, the default)."""
        ...

    def reclaim(self, param: nn.Parameter) -> bool:
        """Put an expert tensor whose memory was replaced by an equal copy (same device type, dtype
        and shape: ``.to("cpu:0")`` copies) back into the memory the server updates, keeping its
        current values. False where nothing was moved or this backend cannot."""
        ...

    def add(self, named: list[tuple[str, nn.Parameter]], hyper_of: HyperOf,
            slices: Mapping[int, int] | None = None) -> None:
        """Place and register more expert tensors (add_param_group); ``slices`` as in ``open``."""
        ...

    def state_transfer(self, amsgrad: bool) -> contextlib.AbstractContextManager[StateTransfer]:
        """Buffers for moving optimizer state (while the context is open)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Memory and request figures of the client side."""
        ...

    def server_stats(self) -> dict[str, Any] | None:
        """The server's counters; None without a server."""
        ...

    def reset_peak(self) -> None:
        ...

    def close(self) -> None:
        """Wait for updates in flight (if the server lives) and end the session."""
        ...

    @property
    def server_address(self) -> str | None:
        ...

    @property
    def server_process(self) -> subprocess.Popen[bytes] | None:
        ...

    @property
    def request_latencies(self) -> list[float]:
        ...

    @property
    def request_traces(self) -> list[RequestTrace]:
        ...

    @property
    def requests_answered(self) -> int:
        ...


def say_hello(conn: Connection, namespace: str | None, fields: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """Open the session: who this client is, and what its path needs (`fields`)."""
    hello: dict[str, Any] = {
        "client": "sonar_moe", "pid": os.getpid(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
        **fields,
    }
    if namespace is not None:
        hello["namespace"] = str(namespace)
    rep = conn.call("hello", hello, timeout=max(timeout, 10.0))
    log.info("connected to sonard %s (protocol %s, pid %s, sqrt %s, namespace %s)", rep.get("server"),
             rep.get("protocol"), rep.get("pid"), rep.get("sqrt"), namespace)
    return rep


class ServerBackend(ABC):
    """What the shared-memory and CUDA paths share: one sonard session for the expert tensors."""

    # Extra keys of every step request.
    _step_body: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def open(cls, server: str | None, named: Iterable[tuple[str, nn.Parameter]], options: BackendOptions,
             hyper_of: HyperOf, counter: Counter, slices: Mapping[int, int] | None = None) -> ServerBackend:
        """Connect (to `server`, or to a new private sonard), say hello, place and register the
        tensors. ``slices``: how many experts each tensor stacks along dim 0, by id of the
        parameter (default: ``shape[0]`` of a tensor of 3 or more dimensions, else 1)."""
        named = list(named)
        cls._check_devices({p.device for _, p in named})
        conn = connect(server, options.timeout)
        try:
            rep = cls._hello(conn, named, options)
            if options.clipper is not None and "grad_scale" not in (rep.get("features") or []):
                raise SonarError("expert_clipping needs a sonard that scales gradients (feature 'grad_scale'); this "
                                 f"one ({rep.get('server')}) does not: update sonard, or build SonarAdamW without "
                                 "expert_clipping")
            backend = cls(conn, rep, named, options, counter, slices)
            backend._register(list(backend._experts.values()), hyper_of)
        except BaseException:
            conn.end_session()
            raise
        return backend

    def __init__(self, conn: Connection, hello: Mapping[str, Any], named: list[tuple[str, nn.Parameter]],
                 options: BackendOptions, counter: Counter, slices: Mapping[int, int] | None = None) -> None:
        self._conn = conn
        self._end_session = weakref.finalize(self, conn.end_session)  # also at exit, if never closed
        if options.ring_layers is None:
            options = dataclasses.replace(options, ring_layers=self.default_ring_layers(conn))
        self._options = options
        self._counter = counter
        self._experts = {id(p): Expert.of(name, p, slices) for name, p in named}
        self._by_tid: dict[int, Expert] = {}
        body = dict(self._step_body)
        if options.clipper is not None:
            body["norms"] = True
        self._steps = StepQueue(conn, self._release, body, self._refused,
                                options.clipper.add_expert_sq_norms if options.clipper is not None else None)
        self._peak = 0
        self._room_wait_s = 0.0  # time the gradient hooks waited for room in the ring
        self._ends_step: bool | None = None  # set_step_boundary
        self._server_workers = int(hello.get("workers") or 0)  # the server's CPU update workers
        self._server_isa = str(hello.get("isa") or "")  # the vector instructions of its CPU kernels
        self._features = set(hello.get("features") or [])

    # ------------------------------------------------------------ path-specific
    def default_ring_layers(self, conn: Connection) -> int:
        """``ring_layers`` when the caller gave none: one layer may wait, so that the server's
        work overlaps backward (the CUDA path: the updates run on the GPU)."""
        return 1

    @classmethod
    def _check_devices(cls, devices: set[torch.device]) -> None:
        """Refuse devices this path cannot serve, before anything starts."""

    @classmethod
    def _hello(cls, conn: Connection, named: list[tuple[str, nn.Parameter]], options: BackendOptions) -> dict[str, Any]:
        """Open the session (hello with what this path needs); the server's reply."""
        return say_hello(conn, options.namespace, {}, options.timeout)

    @abstractmethod
    def _param_ref(self, e: Expert) -> MemRef:
        """Where the server finds the parameter (registered in place)."""

    @abstractmethod
    def _stage(self, e: Expert, grad: torch.Tensor, owned: bool) -> Staged:
        """Make the gradient readable by the server (clipped with max_expert_grad_norm);
        free ``e.param.grad`` when owned."""

    @abstractmethod
    def _release(self, token: Any) -> None:
        """The request that read a staged gradient was answered: give its memory back."""

    @abstractmethod
    def _open_transfer(self, amsgrad: bool) -> Transfer:
        """State-transfer buffers."""

    def _place(self, experts: list[Expert]) -> None:
        """Put newly added expert tensors where the server can reach them (before registration)."""

    def _memory_stats(self) -> dict[str, int]:
        return {"ring_bytes": 0, "param_segment_bytes": 0}

    def _close_memory(self) -> None:
        """After the session ended: give back what the path holds."""

    # ------------------------------------------------------------ shared
    def _register(self, experts: list[Expert], hyper_of: HyperOf) -> None:
        """Register expert tensors (one per expert slice with split_experts) and group them."""
        specs = []
        for e in experts:
            if self._options.split_experts and e.slices > 1:
                e.parts = e.slices
            mem = e.tensor
            shape = list(mem.shape)
            if e.parts > 1:  # one expert's slice: [E, ...] -> [...]; flattened [E * I, H] -> [I, H]
                shape = shape[1:] if shape[0] == e.parts else [shape[0] // e.parts, *shape[1:]]
            ref = self._param_ref(e)
            for i in range(e.parts):
                specs.append({"name": e.name if e.parts == 1 else f"{e.name}.{i}", "shape": shape,
                              "dtype": DTYPES[mem.dtype], "hyper": dict(hyper_of(e.param)),
                              "param": {"seg": ref["seg"], "off": ref["off"] + i * e.part_bytes, "nbytes": e.part_bytes}})
        ids = iter(self._register_specs(specs))
        for e in experts:
            e.tids = [next(ids) for _ in range(e.parts)]
            e.ptr, e.dtype = e.tensor.data_ptr(), e.tensor.dtype
            for t in e.tids:
                self._by_tid[t] = e
            self._steps.add_member(e.key)

    def _register_specs(self, specs: list[dict[str, Any]]) -> list[int]:
        """The ids of specs, registered all or none: past MAX_ITEMS tensors (a model of
        per-expert tensors: 128 experts x 3 x 48 layers is 18,432) in several requests, all but
        the last staged with ``more`` (a failing one drops what was staged)."""
        pieces = in_requests(specs)
        if len(pieces) > 1 and "register_more" not in self._features:
            raise SonarError(f"{len(specs)} expert tensors to register, and this sonard takes at most {MAX_ITEMS} in "
                             "one request and cannot stage more (feature 'register_more'): update sonard")
        for piece in pieces[:-1]:
            self._conn.call("register", {"tensors": piece, "more": True})
        ids = list(self._conn.call("register", {"tensors": pieces[-1]})["ids"])
        if len(ids) != len(specs):
            raise SonarError(f"sonard registered {len(ids)} of {len(specs)} expert tensors")
        return ids

    def add(self, named: list[tuple[str, nn.Parameter]], hyper_of: HyperOf,
            slices: Mapping[int, int] | None = None) -> None:
        self.drain()
        self._check_devices({p.device for _, p in named})
        new = [Expert.of(name, p, slices) for name, p in named]
        for e in new:
            self._experts[id(e.param)] = e
        self._place(new)
        self._register(new, hyper_of)

    def reclaim(self, param: nn.Parameter) -> bool:
        return False

    def check(self, param: nn.Parameter) -> None:
        e = self._experts[id(param)]
        t = e.tensor
        if t.data_ptr() != e.ptr or t.dtype != e.dtype:
            raise RuntimeError(
                f"expert tensor {e.name} was moved or changed after SonarAdamW was built (it is now {param.dtype} "
                f"on {param.device}, not the {e.dtype} memory sonard updates): model.share_memory(), .to(), "
                ".half() and the like replace a parameter's memory, and the server would update a stale copy. "
                "Move or cast the model first, then build SonarAdamW")

    def _refused(self, items: list[dict[str, Any]]) -> None:
        """The server refused a request: the steps it would have applied were not taken."""
        for it in items:
            e = self._by_tid.get(it["tensor"])
            if e is not None and it.get("apply") and (e.parts == 1 or it["tensor"] == e.tids[0]):
                self._counter.retreat(e.param, int(it["step"]))

    def hand_over(self, param: nn.Parameter, grad: torch.Tensor, owned: bool) -> None:
        e = self._experts[id(param)]
        staged = self._stage(e, local(grad), owned)
        del grad
        self._queue(e, staged)
        if self._options.ring_layers == 0 and self._conn.in_flight:
            # The hook that sent a request waits for its reply (a refusal is raised at step()):
            # a batched expert tensor's own update, or a layer of per-expert tensors at its last.
            self._conn.wait()

    def set_grad_accumulation_steps(self, k: int) -> None:
        pending = [e.name for e in self._experts.values() if e.micro > 0]
        if pending:
            raise RuntimeError(f"cannot change gradient accumulation with micro-batches of {pending[:3]} pending: "
                               "call step() first")
        self._options = dataclasses.replace(self._options, grad_accumulation_steps=k)

    def set_step_boundary(self, ends_step: bool | None) -> None:
        self._ends_step = ends_step

    def _queue(self, e: Expert, staged: Staged) -> None:
        """Queue the step of e's staged gradient: one request per expert slice with
        split_experts, else one per MoE block (group_key); applied at the k-th micro-batch."""
        micro = e.micro + 1
        apply = micro >= self._options.grad_accumulation_steps if self._ends_step is None else self._ends_step
        try:
            # advance() may refuse (a group's options): then nothing is counted, the micro-batches
            # summed so far stay pending (zero_grad() discards them) and the staged copy is freed
            step, scalars = self._counter.advance(e.param) if apply else (0, {})
        except BaseException:
            self._release(staged.token)
            raise
        e.micro = 0 if apply else micro
        if apply:
            # The server changes the parameter in place behind autograd's back: bump its version
            # as torch's in-place ops do, so that a node of this backward that saved the tensor
            # (a detached use recorded earlier in the forward) and has not run yet raises torch's
            # "modified by an inplace operation" instead of reading the updated values.
            torch.autograd.graph.increment_version(e.tensor)
        size = e.part_bytes
        items = [{"tensor": tid, "grad": {"seg": staged.seg, "off": staged.off + i * size, "nbytes": size},
                  "apply": apply, "step": step, "scalars": scalars} for i, tid in enumerate(e.tids)]
        if apply:
            self._scale(items)
        if e.parts > 1:
            self._steps.send_each(items, staged.token)
        else:
            self._steps.add(e.key, items[0], staged.token)

    def _scale(self, items: list[dict[str, Any]]) -> None:
        """expert_clipping: the factor of this step's applied gradients goes with each item."""
        clipper = self._options.clipper
        if clipper is not None and clipper.scale != 1.0:
            for it in items:
                it["grad_scale"] = clipper.scale

    def _next_step(self, e: Expert) -> tuple[int, dict[str, Any]]:
        step = self._counter.advance(e.param)
        e.micro = 0
        return step

    def _make_room(self) -> bool:
        """Wait for a reply, or send incomplete layers; False when nothing is outstanding."""
        if self._conn.in_flight:
            t = time.perf_counter()
            self._conn.wait_any()
            self._room_wait_s += time.perf_counter() - t
            return True
        return self._steps.flush()

    def drain(self) -> None:
        self._steps.flush()
        leftovers = [e for e in self._experts.values() if e.micro > 0]
        if leftovers:  # tensors that missed some of this step's micro-batches
            items = []
            for e in leftovers:
                step, sc = self._next_step(e)
                items += [{"tensor": tid, "grad": no_ref(), "apply": True, "step": step, "scalars": sc}
                          for tid in e.tids]
            self._scale(items)
            self._steps.send(items, [])
        self._steps.wait()

    def settle(self) -> None:
        self._steps.flush()
        self._steps.wait()

    def pending(self) -> bool:
        return any(e.micro > 0 for e in self._experts.values())

    def abandon(self) -> None:
        e_pending = [e for e in self._experts.values() if e.micro > 0]
        if not e_pending:
            return
        if "discard" not in self._features:
            raise SonarError("dropping the micro-batches of a step abandoned before step() needs a sonard with the "
                             "'discard' operation; this one is older: update sonard")
        for piece in in_requests([tid for e in e_pending for tid in e.tids]):
            self._conn.call("discard", {"tensors": piece})
        for e in e_pending:
            e.micro = 0

    @contextlib.contextmanager
    def state_transfer(self, amsgrad: bool) -> Iterator[StateTransfer]:
        xfer = self._open_transfer(amsgrad)
        try:
            yield xfer
        finally:
            xfer.close()

    def stats(self) -> dict[str, Any]:
        return {"peak_expert_grad_bytes": self._peak, **self._memory_stats(),
                "step_requests": self._steps.step_requests, "grads_sent": self._steps.grads_sent,
                "bytes_sent": self._steps.bytes_sent, "room_wait_s": self._room_wait_s,
                "ring_layers": self._options.ring_layers, "server_workers": self._server_workers,
                "server_isa": self._server_isa, "openmp_parks": self._conn.waiter.parks,
                "openmp_steered": self._conn.waiter.steered}

    def server_stats(self) -> dict[str, Any] | None:
        return self._conn.call("stats", {})

    def reset_peak(self) -> None:
        self._peak = 0

    def close(self) -> None:
        try:
            if self._conn.in_flight and self._conn.server_alive:
                # Only the updates already sent are waited for: gradients still queued, and
                # micro-batches summed for a step that never came to step(), are dropped, as
                # torch applies nothing without step() (drain() would apply them).
                self._steps.wait()
        finally:
            self._end_session()
            self._close_memory()

    @property
    def server_address(self) -> str | None:
        return self._conn.address

    @property
    def server_process(self) -> subprocess.Popen[bytes] | None:
        return self._conn.process

    @property
    def request_latencies(self) -> list[float]:
        return list(self._conn.latencies)

    @property
    def request_traces(self) -> list[RequestTrace]:
        return list(self._conn.traces)

    @property
    def requests_answered(self) -> int:
        return self._conn.answered


class Transfer(ABC):
    """The shared part of a state transfer: export/import requests per server tensor.

    The tensors of a ``fetch_all``/``store_all`` go in batches of up to ``BATCH_BYTES`` of
    state buffers (at least one tensor): a batch's requests are all sent before any reply is
    waited for, so that a model of thousands of small expert tensors (a ``ModuleList`` of
    experts) pays a round trip a batch, not one a tensor (``state_dict()`` of 12,288 tensors
    took 3.5 s one by one). A subclass makes room for a transfer (``_begin``) and gives each
    tensor of a batch a slot of its own there (``_slot``), valid until ``_reset``."""

    BATCH_BYTES = 64 << 20

    def __init__(self, conn: Connection, experts: Mapping[int, Expert], amsgrad: bool) -> None:
        self._conn = conn
        self._experts = experts
        self._n = 3 if amsgrad else 2

    def _begin(self, es: list[Expert]) -> None:
        """A transfer of es starts (for a subclass that makes its buffers once)."""

    @abstractmethod
    def _slot(self, e: Expert) -> Any:
        """Buffers for e's states in this batch, or None when the batch is full (never for the
        batch's first tensor)."""

    @abstractmethod
    def _views(self, e: Expert, slot: Any) -> list[torch.Tensor]:
        """The slot's exp_avg, exp_avg_sq (and max_exp_avg_sq) buffers, shaped like e's parameter."""

    @abstractmethod
    def _refs(self, e: Expert, slot: Any, part: int) -> list[MemRef]:
        """The three state MemRefs of server tensor `part` of e in `slot` (unused ones: no_ref())."""

    def _ready(self) -> None:
        """The batch's buffers are written (for a subclass whose writes complete later)."""

    def _reset(self) -> None:
        """The batch is done: its slots may be reused."""

    def close(self) -> None:
        """Give the buffers back."""

    def _body(self, e: Expert, slot: Any, step: int, part: int) -> dict[str, Any]:
        refs = self._refs(e, slot, part)
        return {"tensor": e.tids[part], "step": step, "exp_avg": refs[0], "exp_avg_sq": refs[1],
                "max_exp_avg_sq": refs[2]}

    def _batches(self, es: list[Expert]) -> Iterator[list[tuple[int, Any]]]:
        """es's indexes with their slots, a batch at a time; each batch is used up before the next."""
        if not es:
            return
        self._begin(es)
        batch: list[tuple[int, Any]] = []
        for i, e in enumerate(es):
            slot = self._slot(e)
            if slot is None:
                yield batch
                self._reset()
                batch = []
                slot = self._slot(e)
                assert slot is not None
            batch.append((i, slot))
        if batch:
            yield batch
            self._reset()

    def _exchange(self, op: str, requests: list[tuple[int, dict[str, Any]]]) -> tuple[list[int], str | None]:
        """Send every request (index, body) of a batch, then wait for every reply (none is left
        unanswered); the indexes whose requests all succeeded, in order, and the first refusal's
        reason (None: none). A server gone is raised at once."""
        self._ready()
        sent = [(i, self._conn.send(op, body)) for i, body in requests]
        failed: dict[int, str] = {}
        for i, rid in sent:
            rep = self._conn.wait(rid)
            if not rep.get("ok") and i not in failed:
                failed[i] = str(rep.get("error"))
        done = [i for i in dict.fromkeys(i for i, _ in requests) if i not in failed]
        return done, next(iter(failed.values()), None)

    def fetch(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        return self.fetch_all([param])[0]

    def fetch_all(self, params: list[nn.Parameter]) -> list[dict[str, torch.Tensor]]:
        """fetch() of each of params, in order."""
        es = [self._experts[id(p)] for p in params]
        out: list[dict[str, torch.Tensor]] = [{} for _ in es]
        for batch in self._batches(es):
            _, refused = self._exchange("export", [(i, self._body(es[i], slot, 0, part)) for i, slot in batch
                                                   for part in range(es[i].parts)])
            if refused is not None:
                raise SonarRefused(f"sonard refused export: {refused}")
            for i, slot in batch:
                out[i] = self._read(es[i], slot)
        return out

    # The views of a slot live only in these two: a view of shared memory left in a frame (a
    # traceback's) would keep the segment's mapping from closing.
    def _read(self, e: Expert, slot: Any) -> dict[str, torch.Tensor]:
        return {k: like(e.param, v.clone()) for k, v in zip(STATE_KEYS, self._views(e, slot))}

    def _write(self, e: Expert, slot: Any, state: Mapping[str, torch.Tensor | None]) -> None:
        for k, view in zip(STATE_KEYS, self._views(e, slot)):
            src = state.get(k)
            if src is None:
                view.zero_()
            else:
                view.copy_(local(src))

    def store_all(self, items: list[tuple[nn.Parameter, int, Mapping[str, torch.Tensor | None]]],
                  stored: Callable[[nn.Parameter], None] | None = None) -> None:
        """Set each item's (param, step, state) server state, every shape checked before anything
        is sent; stored(param) is called for each one the server took, in order (also for those
        the server took in the batch of a refusal, which is raised after them)."""
        es = [self._experts[id(p)] for p, _, _ in items]
        for e, (_, _, state) in zip(es, items):
            for k in STATE_KEYS[:self._n]:
                src = state.get(k)
                if src is None:
                    continue
                if src.shape != e.param.shape:
                    raise ValueError(f"state {k} of {e.name} has shape {tuple(src.shape)}, want {tuple(e.param.shape)}")
                local_state(e.name, k, e.param, src)  # a DTensor's spec is the parameter's
        for batch in self._batches(es):
            for i, slot in batch:
                self._write(es[i], slot, items[i][2])
            done, refused = self._exchange("import", [(i, self._body(es[i], slot, items[i][1], part))
                                                      for i, slot in batch for part in range(es[i].parts)])
            if stored is not None:
                for i in done:
                    stored(items[i][0])
            if refused is not None:
                raise SonarRefused(f"sonard refused import: {refused}")


class NoExperts:
    """The backend of an optimizer without expert tensors: no server, nothing to hand over."""

    def hand_over(self, param: nn.Parameter, grad: torch.Tensor, owned: bool) -> None:
        raise ValueError("this optimizer has no expert tensors")

    def drain(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def pending(self) -> bool:
        return False

    def abandon(self) -> None:
        pass

    def check(self, param: nn.Parameter) -> None:
        pass

    def set_grad_accumulation_steps(self, k: int) -> None:
        pass

    def set_step_boundary(self, ends_step: bool | None) -> None:
        pass

    def reclaim(self, param: nn.Parameter) -> bool:
        return False

    def add(self, named: list[tuple[str, nn.Parameter]], hyper_of: HyperOf,
            slices: Mapping[int, int] | None = None) -> None:
        raise AssertionError("NoExperts.add: the optimizer opens a server backend for its first expert tensors")

    @contextlib.contextmanager
    def state_transfer(self, amsgrad: bool) -> Iterator[StateTransfer]:
        yield _NoTransfer()

    def stats(self) -> dict[str, Any]:
        return {"peak_expert_grad_bytes": 0, "ring_bytes": 0, "param_segment_bytes": 0,
                "step_requests": 0, "grads_sent": 0, "bytes_sent": 0}

    def server_stats(self) -> dict[str, Any] | None:
        return None

    def reset_peak(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def server_address(self) -> str | None:
        return None

    @property
    def server_process(self) -> subprocess.Popen[bytes] | None:
        return None

    @property
    def request_latencies(self) -> list[float]:
        return []

    @property
    def request_traces(self) -> list[RequestTrace]:
        return []

    @property
    def requests_answered(self) -> int:
        return 0


class _NoTransfer:
    def fetch(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        raise ValueError("this optimizer has no expert tensors")

    def fetch_all(self, params: list[nn.Parameter]) -> list[dict[str, torch.Tensor]]:
        if params:
            raise ValueError("this optimizer has no expert tensors")
        return []

    def store_all(self, items: list[tuple[nn.Parameter, int, Mapping[str, torch.Tensor | None]]],
                  stored: Callable[[nn.Parameter], None] | None = None) -> None:
        if items:
            raise ValueError("this optimizer has no expert tensors")
