"""An expert-parallel MoE layer over torch.distributed, trained with SonarAdamW.

Each rank owns ``num_experts / world_size`` experts (one contiguous block, kept as batched
``[E_local, 2I, H]`` / ``[E_local, H, I]`` tensors, so SonarAdamW auto-detects them). Tokens go
to the rank that owns their expert and come back with two ``all_to_all_single`` calls (uneven
splits; gloo implements it on CPU), whose backward is the reverse all-to-all. The router and
every other dense parameter are replicated and all-reduced by DDP; the experts are excluded
from DDP (they are not replicated) and updated during backward by SonarAdamW's own hooks.

    python examples/ep_moe.py --nproc 2 --steps 30 [--check]

starts ``--nproc`` ranks (gloo over loopback TCP), one ``sonard`` per node shared by the
node's ranks, and trains the tiny byte-level MoE of ``tiny_moe.py`` with its MoE layers made
expert parallel. ``--check`` also trains the same model with ``torch.optim.AdamW`` in each rank
and checks that every parameter stays bit-for-bit equal.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "pyclient")]

import tiny_moe as tm  # noqa: E402


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward sends gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-to-all: rows ``in_splits[r]`` of ``x`` go to rank r; ``out_splits[r]``
    rows come from rank r."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class EPExperts(nn.Module):
    """This rank's experts ``[first, first + num_local)`` as batched tensors.

    ``grad_scale``: each local expert sees the tokens of every rank, so autograd gives it the
    *sum* of the ranks' loss gradients, while DDP *averages* the dense ones. Scaling the expert
    gradients by ``1 / world_size`` (a tensor hook, before accumulation) makes both the gradient
    of the mean loss over ranks.
    """

    def __init__(self, num_local: int, hidden: int, intermediate: int, first: int, grad_scale: float = 1.0) -> None:
        super().__init__()
        self.first = first
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate))
        if grad_scale != 1.0:
            for p in (self.gate_up_proj, self.down_proj):
                p.register_hook(lambda g, s=grad_scale: g * s)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_proj[e].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[e].T


class EPMoE(nn.Module):
    """Top-k MoE with experts sharded over the ranks of ``group`` (the same routing and expert
    math as ``tiny_moe.MoE``)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.world} ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = EPExperts(self.num_local, hidden, intermediate, self.rank * self.num_local,
                                 grad_scale=1.0 / self.world)

    @classmethod
    def from_moe(cls, moe: tm.MoE, group: dist.ProcessGroup | None = None) -> EPMoE:
        """This rank's shard of a ``tiny_moe.MoE`` with batched experts (same weights)."""
        if not isinstance(moe.experts, tm.BatchedExperts):
            raise ValueError("expert parallelism needs the batched expert layout")
        e, two_i, h = moe.experts.gate_up_proj.shape
        ep = cls(h, two_i // 2, e, moe.top_k, group).to(moe.router.weight.dtype)
        lo, hi = ep.experts.first, ep.experts.first + ep.num_local
        with torch.no_grad():
            ep.router.weight.copy_(moe.router.weight)
            ep.experts.gate_up_proj.copy_(moe.experts.gate_up_proj[lo:hi])
            ep.experts.down_proj.copy_(moe.experts.down_proj[lo:hi])
        return ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)

        # One row per (token, slot) assignment, sorted by expert: rows for rank r are contiguous.
        expert_of = chosen.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        sorted_expert = expert_of[order]
        dest = torch.div(sorted_expert, self.num_local, rounding_mode="floor")
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        local_ids = torch.empty(sum(recv_splits), dtype=torch.long)
        dist.all_to_all_single(local_ids, sorted_expert - dest * self.num_local, recv_splits, send_splits,
                               group=self.group)

        token = torch.div(order, self.top_k, rounding_mode="floor")
        x_in = all_to_all(flat[token], recv_splits, send_splits, self.group)
        y_in = torch.zeros_like(x_in)
        for e in range(self.num_local):
            rows = (local_ids == e).nonzero(as_tuple=True)[0]
            # Runs even with no rows, so every local expert tensor gets a gradient each step.
            y_in = y_in.index_add(0, rows, self.experts.expert(e, x_in[rows]))
        y = all_to_all(y_in, send_splits, recv_splits, self.group)
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(flat).index_add(0, token, y * w[:, None])
        return out.view(shape)


def build_ep(cfg: tm.MoEConfig, seed: int, group: dist.ProcessGroup | None = None) -> tm.TinyMoE:
    """``tiny_moe.build(cfg, seed)`` with every MoE layer replaced by this rank's expert shard."""
    model = tm.build(cfg, seed)
    for block in model.layers:
        moe = block.moe
        assert isinstance(moe, tm.MoE)
        block.moe = EPMoE.from_moe(moe, group)
    return model


# ----------------------------------------------------------------------- demo
def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import sonar_moe
    from sonar_moe.distributed import NodeServer, ignore_experts_in_ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ["SONAR_NODE_ID"] = f"node{rank // args.ranks_per_node}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ep_group = dist.new_group(backend="gloo")  # all-to-alls apart from DDP's all-reduces
    assert isinstance(ep_group, dist.ProcessGroup)  # this rank is in the group
    cfg = tm.MoEConfig(num_layers=2, num_experts=4 * world, hidden=32, intermediate=48, seq_len=32)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = tm.batches(tm.load_corpus(200_000), 4, 32, gen)
    with NodeServer() as node:
        model = build_ep(cfg, 0, ep_group)
        ignore_experts_in_ddp(model)
        ddp = DDP(model)
        ref: tuple[DDP, torch.optim.AdamW, list[nn.Parameter]] | None = None
        if args.check:
            ref_model = build_ep(cfg, 0, ep_group)
            ignored = set(ignore_experts_in_ddp(ref_model))
            ref_ddp = DDP(ref_model)
            dense = [p for n, p in ref_model.named_parameters() if n not in ignored]
            ref = (ref_ddp, torch.optim.AdamW(ref_ddp.parameters(), lr=2e-3), dense)
        opt = sonar_moe.SonarAdamW(ddp, lr=2e-3, max_grad_norm=1.0, **node.optimizer_kwargs())
        t0 = time.perf_counter()
        for step in range(args.steps):
            x = next(data)
            if ref is not None:
                ref_ddp, ropt, dense = ref
                loss, _ = ref_ddp(x, labels=x)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(dense, 1.0)
                ropt.step()
                ropt.zero_grad()
            loss, _ = ddp(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if ref is not None:
                same = all(torch.equal(a, b) for a, b in zip(ref[0].parameters(), ddp.parameters()))
                if not same:
                    raise SystemExit(f"rank {rank}: parameters differ from torch.optim.AdamW at step {step + 1}")
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step + 1:4d}  loss {mean.item() / world:.4f}", flush=True)
        secs = time.perf_counter() - t0
        st = opt.stats()
        opt.close()
        if rank == 0:
            print(f"{world} ranks, {args.steps} steps in {secs:.1f} s; rank 0 sent {st['grads_sent']} expert "
                  f"gradients to node {node.node_id}'s sonard ({node.address})"
                  + ("; every parameter bitwise equal to torch.optim.AdamW" if args.check else ""), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=0, help="ranks sharing one sonard (default: all)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="compare with torch.optim.AdamW, bit for bit")
    args = ap.parse_args()
    args.ranks_per_node = args.ranks_per_node or args.nproc
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
