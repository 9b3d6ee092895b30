"""SonarAdamW under torch.distributed: data parallel (DDP), expert parallel, one sonard per node.

Three pieces, each usable alone (design and limits: ``docs/distributed.md``):

* :func:`register_ddp_comm_hook` — DDP with experts *replicated*. A post-accumulate-grad hook
  fires on the rank-local gradient, before DDP's all-reduce, so SonarAdamW's own hooks are
  removed and the expert tensors are handed over from a DDP communication hook instead, with
  the gradient averaged exactly as DDP's built-in reduction does. Bit-for-bit equal to DDP with
  ``torch.optim.AdamW``. SonarAdamW does this by itself (:class:`DDPWatch`): when built on a
  DDP model, or at the first forward of a DDP model that wraps it later (Trainer, accelerate).
* :func:`ignore_experts_in_ddp` — expert parallel: every rank owns a shard of the experts, which
  DDP must not touch (they are not replicated). SonarAdamW's own hooks are then exactly right:
  the local gradient *is* the final gradient of a local expert.
* :class:`NodeServer` — one ``sonard`` per node, started by the node's first rank and shared by
  all its ranks, each rank in its own session (its own tensors and segments). Under torchrun or
  ``accelerate launch`` this happens without it, from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
  (``_node.py``).

Expert tensors may be CPU or CUDA tensors, as for SonarAdamW itself (the CUDA path is wired
into sonard: expert tensors registered in place by CUDA IPC handle, docs/gpu.md). The tests run
``gloo`` with CPU tensors; ``nccl`` with CUDA experts has not been run yet.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Callable
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from ._connection import Connection, SonarError
from ._launch import start_private_server
from ._detect import find_experts
from .optimizer import SonarAdamW

log = logging.getLogger("sonar_moe")

__all__ = ["DDPExpertHook", "DDPWatch", "NodeServer", "check_local_gradients", "ignore_experts_in_ddp",
           "reduces_experts", "register_ddp_comm_hook", "unwatch", "watch_for_ddp"]

_engine = torch.autograd.Variable._execution_engine


# --------------------------------------------------------------------------- DDP
class DDPExpertHook:
    """State of the DDP communication hook that feeds averaged expert gradients to SonarAdamW.

    Made by :func:`register_ddp_comm_hook`. For every gradient bucket the hook scales the
    bucket by ``1/world_size`` and all-reduces it (sum), which is what DDP's built-in reduction
    does. Expert slices of a bucket are handed to the optimizer on the training thread once
    their all-reduce has finished: at a later bucket's hook when it is already done (so the
    server updates layer L while autograd computes layer L-1), the rest at the end of backward.
    After DDP has written the averaged gradients back into ``.grad``, the expert ``.grad`` are
    set to ``None`` (they are applied).

    With ``find_unused_parameters=True`` a bucket slot of a parameter that no rank used holds
    zeros, while DDP leaves that parameter's ``.grad`` untouched and AdamW skips it; only DDP
    knows which slots those are. In that mode the experts are handed over at the end of
    backward from ``.grad`` itself, as ``torch.optim.AdamW`` would read it (``None``: no step,
    unless the script zeroes with ``set_to_none=False``, where torch's ``.grad`` would be the
    zero it keeps: ``SonarAdamW.step()`` steps such a tensor with that zero, as torch does).
    """

    def __init__(self, ddp: DistributedDataParallel, opt: SonarAdamW) -> None:
        self.ddp = ddp
        self.opt = opt
        self.process_group = ddp.process_group
        self.world_size = dist.get_world_size(self.process_group)
        # DDP's built-in reduction multiplies each gradient by (1.0 / world_size) while copying it
        # into the bucket (at::mul_out with a double scalar); so do we, in place.
        self.scale = 1.0 / self.world_size
        self.after_reduce = bool(getattr(ddp, "find_unused_parameters", False))
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        expert_ids = {id(p) for _, p in opt.named_expert_parameters()}
        self.experts: dict[int, nn.Parameter] = {}
        skipped = []
        for name, p in ddp.module.named_parameters():
            if id(p) in expert_ids:
                if name in ignored:
                    skipped.append(name)
                else:
                    self.experts[id(p)] = p
        if not self.experts:
            raise ValueError("no expert tensor of this SonarAdamW is reduced by this DDP model: for experts that "
                             "DDP ignores (expert parallel), keep SonarAdamW's own hooks and do not register this hook")
        if skipped:
            raise ValueError(f"DDP ignores some expert tensors ({skipped[:3]}...) but reduces others: mixing "
                             "replicated and expert-parallel experts in one SonarAdamW is not supported")
        if len(self.experts) != len(expert_ids):
            raise ValueError("some expert tensors of this SonarAdamW are not parameters of the DDP model")
        self._pending: list[tuple[torch.futures.Future[Any], list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._queued = False
        self.counts = {"buckets": 0, "handed_in_hooks": 0, "handed_at_end": 0, "handed_after_reduce": 0}
        # backward passes that all-reduced since the optimizer's step ended (opt.ended_steps was
        # _step_at then: step(), or a zero_grad() that dropped a backward no step() followed)
        self._syncs_since_step = 0
        self._step_at = opt.ended_steps
        # DDP puts each gradient's bucket view back in .grad (the same tensor every step) once
        # the gradient is in: the .grad at the first bucket's hook no longer tell how the script
        # zeroed them (SonarAdamW.check_new_step)
        self._views_in_grads = bool(getattr(ddp, "gradient_as_bucket_view", False))

    def on_forward(self, module: nn.Module, args: Any) -> None:
        """DDP forward pre-hook: a backward that raised never ran our end-of-backward callback,
        so every forward starts afresh. Inside ``ddp.join()`` (uneven inputs) it refuses to run."""
        _refuse_join(self.ddp)
        self._queued = False
        self._pending = []

    # Runs in the autograd engine (the training thread on CPU), once per bucket.
    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        buf.mul_(self.scale)
        fut = (dist.all_reduce(buf, group=self.process_group, async_op=True)
               .get_future().then(lambda f: f.value()[0]))
        self.counts["buckets"] += 1
        if not self._queued:
            # before this step's first all-reduce: every rank refuses alike, none is left waiting
            self.opt.check_new_step("DDP was handed a new step's gradients", tells_zeroing=not self._views_in_grads)
            if self.opt.ended_steps != self._step_at:
                self._step_at = self.opt.ended_steps
                self._syncs_since_step = 0
            self._syncs_since_step += 1
            if self._syncs_since_step > 1:
                raise RuntimeError(
                    "DDP all-reduced the gradients of a second backward before opt.step(): SonarAdamW applies the "
                    "expert gradients during backward, so this would apply two steps where torch.optim.AdamW takes "
                    "one. Accumulate with ddp.no_sync() (or accelerator.accumulate(model), as Trainer does) for all "
                    "but the last micro-batch, then call opt.step(). (Reentrant activation checkpointing, "
                    "torch.utils.checkpoint(use_reentrant=True), runs backward passes inside backward and ends up "
                    "here too: use use_reentrant=False)")
            self._queued = True
            _engine.queue_callback(self._end_of_backward)  # runs before DDP's finalize (queued later)
        if not self.after_reduce:
            mine = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if id(p) in self.experts]
            if mine:
                self._pending.append((fut, mine))
            self._hand_over_done()
        return fut

    def _hand_over_done(self) -> None:
        """Hand over the experts of buckets whose all-reduce has finished, never waiting."""
        while self._pending and self._pending[0][0].done():
            fut, mine = self._pending.pop(0)
            fut.wait()  # raises if the all-reduce failed
            for p, g in mine:
                self.opt.hand_over_grad(p, g)
                self.counts["handed_in_hooks"] += 1

    def _end_of_backward(self) -> None:
        self._queued = False
        pending, self._pending = self._pending, []
        for fut, mine in pending:
            fut.wait()
            for p, g in mine:
                self.opt.hand_over_grad(p, g)
                self.counts["handed_at_end"] += 1
        # DDP's finalize_backward (queued after us) copies the averaged buckets into .grad;
        # a callback queued now runs after it.
        _engine.queue_callback(self._after_reduce)

    def _after_reduce(self) -> None:
        for p in self.experts.values():
            if p.grad is None:
                continue
            if self.after_reduce:
                self.opt.hand_over_grad(p, p.grad)
                self.counts["handed_after_reduce"] += 1
            p.grad = None


def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP compares them with dist.GradBucket, and this module's are strings.
    return state._hook(bucket)


def register_ddp_comm_hook(ddp: DistributedDataParallel, opt: SonarAdamW) -> DDPExpertHook:
    """Make SonarAdamW apply the *all-reduced* expert gradients of a DDP model.

    SonarAdamW does this by itself: when built on a DDP model, or at the first forward of a DDP
    model that reduces its expert tensors (Trainer and accelerate wrap the model after the
    optimizer exists). Calling it by hand (before the first backward) is still allowed and
    returns the same hook. Replaces DDP's default reduction with the same averaging all-reduce
    and removes SonarAdamW's post-accumulate-grad hooks (they see the local gradient).

    Gradient accumulation under DDP is ``ddp.no_sync()`` for all but the last micro-batch (what
    Trainer and ``accelerator.accumulate`` do): ``.grad`` sums the micro-batches locally, DDP
    all-reduces once, and that sum is applied at once whatever ``grad_accumulation_steps`` says.
    A second all-reduce before ``opt.step()`` (accumulation without ``no_sync``) is an error.
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(ddp).__name__}")
    if not isinstance(opt, SonarAdamW):
        raise TypeError(f"expected a SonarAdamW, got {type(opt).__name__}")
    if opt.ddp_hook is not None:
        if opt.ddp_hook.ddp is ddp:
            return opt.ddp_hook
        raise ValueError("this SonarAdamW already takes its expert gradients from another DDP model")
    _check_ddp_options(ddp)
    reclaim(opt)
    state = DDPExpertHook(ddp, opt)
    try:
        ddp.register_comm_hook(state, _comm_hook)
    except RuntimeError as e:
        raise RuntimeError(
            "SonarAdamW needs its own DDP communication hook to apply the all-reduced expert gradients, but this "
            f"DDP model already has one ({e}). A compression hook (fp16, PowerSGD) cannot be combined with it; "
            "remove it, or keep the experts out of DDP (expert parallel, docs/distributed.md)") from e
    ddp.register_forward_pre_hook(state.on_forward)
    opt.remove_grad_hooks()
    opt.accumulate_before_hand_over()
    opt.ddp_hook = state
    _WATCH.forget(opt)
    log.info("SonarAdamW applies the expert gradients all-reduced by DDP (%d expert tensors, world size %d)",
             len(state.experts), state.world_size)
    global _MEMORY_WARNED
    if not _MEMORY_WARNED:
        _MEMORY_WARNED = True
        log.warning("SonarAdamW under DDP with replicated experts: DDP's buckets hold every expert gradient, so the "
                    "gradient memory is DDP's, not one layer; the expert optimizer states live in sonard. Expert "
                    "parallel keeps the one-layer bound (docs/distributed.md)")
    return state


_MEMORY_WARNED = False


def _join_enabled(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` runs inside a ``Join`` context now. torch has no public accessor: Joinable
    keeps its configuration in ``_join_config``, which ``Join`` enables for the context's duration."""
    config = getattr(ddp, "_join_config", None)
    return bool(getattr(config, "enable", False))


def _refuse_join(ddp: DistributedDataParallel) -> None:
    if _join_enabled(ddp):
        raise NotImplementedError(
            "SonarAdamW under DDP's join() (uneven inputs) is not supported: a rank that has joined runs the "
            "communication hook outside backward, and divide_by_initial_world_size=False changes DDP's divisor, "
            "which the hook does not follow. Give every rank the same number of batches (drop_last=True)")


def _check_ddp_options(ddp: DistributedDataParallel) -> None:
    """Refuse DDP set-ups whose reduction the communication hook does not reproduce."""
    _refuse_join(ddp)
    if getattr(ddp, "mixed_precision", None) is not None:
        raise NotImplementedError("SonarAdamW with DDP(mixed_precision=...) is not supported: the hook would "
                                  "reduce the low-precision gradients differently from DDP's own path")
    if getattr(ddp, "static_graph", False):
        raise NotImplementedError("SonarAdamW with DDP(static_graph=True) is not supported (its delayed all-reduce "
                                  "was not checked bitwise against DDP); build DDP without static_graph")


# ---------------------------------------------------- finding DDP by itself
class DDPWatch:
    """Finds out whether a DistributedDataParallel model reduces a SonarAdamW's expert tensors.

    One per process. While some SonarAdamW with expert tensors is watched, a global module
    forward pre-hook looks at every DDP model about to run forward (Trainer and accelerate wrap
    the model after building the optimizer, so this is the first moment the wrapping is known,
    and it comes before any backward through it). A DDP model that reduces the optimizer's
    experts gets the communication hook (:func:`register_ddp_comm_hook`), or the forward fails
    with the reason it cannot; one that ignores them (expert parallel) leaves SonarAdamW's own
    hooks in place, which are right there. A process that is not distributed at the first expert
    gradient stops watching (no per-module cost afterwards); a distributed one keeps watching,
    so a model wrapped later is still caught.
    """

    def __init__(self) -> None:
        self._watched: weakref.WeakSet[SonarAdamW] = weakref.WeakSet()
        self._dropped: weakref.WeakSet[SonarAdamW] = weakref.WeakSet()
        # DDP models already looked at for an optimizer whose experts they do not reduce.
        self._seen: weakref.WeakKeyDictionary[DistributedDataParallel, weakref.WeakSet[SonarAdamW]] = \
            weakref.WeakKeyDictionary()
        self._handle: Any = None

    def watch(self, opt: SonarAdamW) -> None:
        self._watched.add(opt)
        self._dropped.discard(opt)
        if self._handle is None:
            self._handle = register_module_forward_pre_hook(self._before_forward)

    def forget(self, opt: SonarAdamW, dropped: bool = False) -> None:
        self._watched.discard(opt)
        if dropped:
            self._dropped.add(opt)
        if not self._watched and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def was_dropped(self, opt: SonarAdamW) -> bool:
        return opt in self._dropped

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not isinstance(module, DistributedDataParallel):
            return
        seen = self._seen.setdefault(module, weakref.WeakSet())
        for opt in list(self._watched):
            if opt in seen or opt.ddp_hook is not None:
                continue
            if opt.closed:
                self.forget(opt)
            elif reduces_experts(module, opt):
                register_ddp_comm_hook(module, opt)
            else:
                seen.add(opt)


_WATCH = DDPWatch()


def reduces_experts(ddp: DistributedDataParallel, opt: SonarAdamW) -> bool:
    """Whether ``ddp`` all-reduces any of ``opt``'s expert tensors (not in its ignore list)."""
    experts = {id(p) for _, p in opt.named_expert_parameters()}
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return any(id(p) in experts and n not in ignored for n, p in ddp.module.named_parameters())


def watch_for_ddp(opt: SonarAdamW, module: nn.Module | None) -> None:
    """Called by SonarAdamW at construction: take the DDP path now if it was built on a DDP
    model that reduces its experts, else watch for one (see :class:`DDPWatch`)."""
    if isinstance(module, DistributedDataParallel) and reduces_experts(module, opt):
        register_ddp_comm_hook(module, opt)
        return
    _WATCH.watch(opt)


def reclaim(opt: SonarAdamW) -> None:
    """Launchers move the model to ``cpu:<n>`` after the optimizer exists, which copies CPU
    tensors: put the expert tensors back where the server updates them (see
    ``SonarAdamW.reclaim_moved_experts``)."""
    moved = opt.reclaim_moved_experts()
    if moved:
        log.info("expert tensors copied after SonarAdamW was built (model.to(cpu:N)), taken back into shared "
                 "memory: %s", moved[:4])


def unwatch(opt: SonarAdamW) -> None:
    """Called by SonarAdamW.close(): nothing to watch for any more."""
    _WATCH.forget(opt)


def check_local_gradients(opt: SonarAdamW) -> None:
    """Called by SonarAdamW's own hook at the first expert gradient of each step.

    In a distributed process the watch has seen every DDP forward since the optimizer was
    built, so no DDP reduces these experts: the local gradient is final (expert parallel,
    FSDP2 with ignored experts, or independent replicas). In a process that is not
    distributed, watching stops. If torch.distributed was initialized only after that, a DDP
    wrapping may have gone unseen, and the update is refused rather than guessed.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        reclaim(opt)
        if _WATCH.was_dropped(opt):
            raise RuntimeError(
                "torch.distributed was initialized after this SonarAdamW's first backward, so it cannot tell "
                "whether a DistributedDataParallel model reduces its expert tensors (their update would then use "
                "the rank-local gradient). Call init_process_group before the first backward, or call "
                "sonar_moe.distributed.register_ddp_comm_hook(ddp_model, opt) yourself")
        return
    _WATCH.forget(opt, dropped=True)


# ------------------------------------------------------------- expert parallel
def ignore_experts_in_ddp(module: nn.Module,
                          expert_params: Callable[[str, torch.Tensor], bool] | None = None) -> list[str]:
    """Tell DDP to leave this rank's expert shards alone (expert parallel); returns their names.

    Call on the plain module before wrapping it in ``DistributedDataParallel``. Expert shards are
    owned by one rank each, so their gradient is final when autograd produces it and must not be
    averaged with other ranks' (different) experts: SonarAdamW's own post-accumulate-grad hooks
    apply them, while DDP all-reduces the dense parameters as usual.
    """
    if isinstance(module, DistributedDataParallel):
        raise TypeError("call ignore_experts_in_ddp on the module before wrapping it in DDP")
    if expert_params is None:  # the same expert tensors SonarAdamW(module) finds
        found = find_experts(module)
        names = [n for n, _ in module.named_parameters() if n in found]
    else:
        names = [n for n, p in module.named_parameters() if expert_params(n, p)]
    if not names:
        raise ValueError("no expert parameters found")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return names


# ---------------------------------------------------------- one sonard per node
class NodeOptimizerKwargs(TypedDict):
    """``NodeServer.optimizer_kwargs()``: the SonarAdamW arguments that point it at the node's server."""

    server: str
    namespace: str


class NodeServer:
    """One ``sonard`` per node, shared by the node's ranks (a collective over ``group``).

    The lowest rank of each node starts the server on an ``ipc://`` socket in a fresh 0700
    directory; every rank learns its node's address through ``all_gather_object``. Pass
    ``server=ns.address, namespace=ns.namespace`` (or ``**ns.optimizer_kwargs()``) to SonarAdamW.
    Each connection is its own session on the server: one rank's tensor ids, segments and
    optimizer state are invisible to the others, and a rank that dies is released alone.

    Nodes are told apart by ``node_id``, else ``$SONAR_NODE_ID``, else the host name (set the
    variable to run several "nodes" on one host, as the tests do). :meth:`close` is collective
    too: it waits until every rank is done (close your optimizers first), then the node's first
    rank stops the server.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, node_id: str | None = None,
                 timeout: float = 30.0, log_level: str = "warn") -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.node_id = str(node_id or os.environ.get("SONAR_NODE_ID") or socket.gethostname())
        keys: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, self.node_id, group=group)
        self.local_ranks = [r for r, k in enumerate(keys) if k == self.node_id]
        self.local_rank = self.local_ranks.index(self.rank)
        self.is_leader = self.local_rank == 0
        self._conn: Connection | None = None
        err = ""
        if self.is_leader:
            try:
                self._conn = start_private_server(timeout, log_level=log_level)
                self._conn.call("hello", {"client": "sonar_moe.NodeServer", "pid": os.getpid()},
                                timeout=max(timeout, 10.0))
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = f"{type(e).__name__}: {e}"
        mine = (self.node_id, self._conn.address if self._conn else None, err)
        infos: list[Any] = [None] * len(keys)
        dist.all_gather_object(infos, mine, group=group)
        leader = infos[self.local_ranks[0]]
        if leader[2]:
            raise SonarError(f"the first rank of node {self.node_id} could not start sonard: {leader[2]}")
        self.address: str = leader[1]
        self.namespace = f"rank{self.rank}"
        self._closed = False
        log.info("rank %d uses node %s's sonard at %s", self.rank, self.node_id, self.address)

    def optimizer_kwargs(self) -> NodeOptimizerKwargs:
        """``server=`` and ``namespace=`` for SonarAdamW."""
        return {"server": self.address, "namespace": self.namespace}

    def stats(self) -> dict[str, Any]:
        """The server's counters (``sessions``, ``tensors``, ``segments``, ...). Leader only: any other
        connection would open a session of its own."""
        if self._conn is None:
            raise SonarError("stats() is available on the node's first rank only")
        return self._conn.call("stats", {})

    def close(self) -> None:
        """Collective: wait for every rank, then stop the node's server."""
        if self._closed:
            return
        self._closed = True
        dist.barrier(group=self.group)
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.shutdown(timeout=10.0)

    def __enter__(self) -> NodeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
