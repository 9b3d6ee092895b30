"""SonarAdamW under torch.distributed (gloo on CPU, one process per rank, loopback TCP):

- DDP with replicated experts: expert updates from the all-reduced buckets (DDP comm hook),
  bit for bit equal to DDP + torch.optim.AdamW (built-in averaging all-reduce, with and without
  dense-only clipping, bucket views, bf16, no_sync accumulation, find_unused_parameters);
- expert parallel: experts sharded over the ranks (all-to-all dispatch), excluded from DDP,
  updated by SonarAdamW's own hooks; bit for bit equal to the same model with torch AdamW;
- one sonard per node shared by the node's ranks, each in its own session.

Each rank compares itself with its own reference run in the same process after every step,
and the ranks compare their replicated parameters with each other (tests/dist_worker.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch

import sonar_moe
import tiny_moe as tm
from conftest import server_stats
from sonar_moe.distributed import ignore_experts_in_ddp

WORKER = str(Path(__file__).with_name("dist_worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: str, world: int, *extra: str, timeout: float = 240) -> list[str]:
    """Run `world` ranks of tests/dist_worker.py; return each rank's output."""
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "SONAR_NODE_ID"}
    procs = [subprocess.Popen([sys.executable, WORKER, cmd, str(r), str(world), port, *extra], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    for r, o in enumerate(outs):
        assert f"[rank {r}] DONE" in o, report
    return outs




def test_ddp_comm_hook_is_bitwise_torch_adamw(shared_server: str) -> None:
    """2 ranks, one sonard started by the test: twelve DDP configurations x 4 steps."""
    outs = launch("ddp", 2, shared_server)
    for r, out in enumerate(outs):
        for case in ("batched-fp32-noclip", "batched-fp32-clip-bucketview", "batched-bf16-clip",
                     "batched-fp32-no_sync-accum2", "modulelist-find_unused-clip", "batched-fp32-local-steps",
                     "modulelist-find_unused-keep-opt", "modulelist-find_unused-keep-model-bucketview",
                     "modulelist-find_unused-keep-model-params", "modulelist-find_unused-model-bucketview",
                     "modulelist-find_unused-model-bucketview-params",
                     "modulelist-find_unused-keep-model-bucketview-params"):
            assert f"[rank {r}] OK {case}" in out, out
    st = server_stats(shared_server)
    assert st["errors"] == 0 and st["step_items"] > 0
    assert st["tensors"] == 0 and st["segments"] == 0  # every rank's optimizers said goodbye


def test_ddp_comm_hook_three_ranks(shared_server: str) -> None:
    """World size 3: 1/3 is not exact, and DDP's built-in reduction multiplies by the float32
    reciprocal (x * (1/3), not x / 3); the hook does the same, so the result stays bitwise."""
    cases = "batched-fp32-noclip,batched-fp32-clip-bucketview"
    outs = launch("ddp", 3, shared_server, cases)
    for r, out in enumerate(outs):
        for case in cases.split(","):
            assert f"[rank {r}] OK {case}" in out, out


def test_expert_parallel_is_bitwise_torch_adamw() -> None:
    """2 ranks, 2 experts each, one sonard started by rank 0 and shared by both ranks."""
    outs = launch("ep", 2)
    for r, out in enumerate(outs):
        assert f"[rank {r}] OK EP gradients match the one-process model" in out, out
        assert f"[rank {r}] OK expert-parallel" in out, out
    addr = [line.rsplit("(", 1)[1] for line in outs[0].splitlines() if "OK expert-parallel" in line]
    assert addr and addr[0] in outs[1]  # both ranks used the same server


def test_two_nodes_one_sonard_each() -> None:
    """4 ranks standing for 2 nodes x 2 ranks: each node's ranks share that node's sonard; experts
    sharded over all 4 ranks."""
    outs = launch("nodes", 4, "2")
    for r, out in enumerate(outs):
        assert f"[rank {r}] OK 2-nodes-x-2-ranks on node node{r // 2}" in out, out


def test_fsdp2_dense_with_expert_parallel_experts() -> None:
    """What composes with FSDP2 today: dense parameters sharded by fully_shard, experts expert
    parallel and left out of FSDP2 (ignored_params), so they stay plain tensors updated by
    SonarAdamW's own hooks; dense-only clipping over the DTensor gradients. Bitwise equal to
    the same set-up with torch.optim.AdamW."""
    outs = launch("fsdp2", 2)
    for r, out in enumerate(outs):
        assert f"[rank {r}] OK fsdp2-dense-ep-experts" in out, out


def test_fsdp2_sharded_experts_are_torchs(tmp_path: Path) -> None:
    """Experts sharded by FSDP2 with the rest of the model (DTensor expert tensors): each rank's
    sonard session updates its local shards during backward, bit for bit as torch.optim.AdamW
    updates the DTensors, 4 steps each: float32 with dense clipping, bfloat16, accumulation 2 with
    amsgrad, fused, FSDP2's bfloat16 mixed precision, and built after FSDP2's first forward and
    backward (its lazy init done). The expert .grad is None after each backward; state_dict()
    holds torch's DTensor state, and loading it changes nothing. Refused before anything moves:
    no module, uneven shards, per-tensor and expert clipping, split_experts; refused at step():
    sharded parameters swapped into the groups (accelerate's FSDP2 preparation). With the experts
    sharded with the layer's dense parameters, the warning that freeing their gradients saves
    nothing comes once; with the experts apart, not at all. A second SonarAdamW on the same model
    takes it over. A torch.distributed.checkpoint save and load into new models resumes as torch's
    does."""
    outs = launch("fsdp2-experts", 2, str(tmp_path))
    for r, out in enumerate(outs):
        for case in ("fp32-clip-apart", "bf16-noclip-late", "fp32-accum2-amsgrad-apart", "fp32-fused-late-apart",
                     "fp32-mixed-bf16-clip", "refusals", "takeover", "dcp"):
            assert f"[rank {r}] OK fsdp2-experts {case}" in out, out


def test_fsdp2_sharded_experts_of_transformers_models() -> None:
    """transformers' OLMoE and GraniteMoe built from configs, each decoder layer and the root
    sharded by FSDP2 (the batched experts too): bit for bit as torch.optim.AdamW over 3 steps,
    float32 eager and bfloat16 grouped_mm."""
    outs = launch("fsdp2-hf", 2)
    for r, out in enumerate(outs):
        for case in ("tiny_olmoe eager float32", "tiny_granite eager float32",
                     "tiny_olmoe grouped_mm bfloat16", "tiny_granite grouped_mm bfloat16"):
            assert f"[rank {r}] OK fsdp2-hf {case}" in out, out


def test_hsdp_sharded_experts_are_torchs(tmp_path: Path) -> None:
    """HSDP: 4 ranks on a 2 x 2 mesh, each tensor sharded over 2 ranks and replicated over the
    other 2, every rank fed its own batches (FSDP2 all-reduces each reduce-scattered gradient over
    the replicas before SonarAdamW's hook gets it): float32 with clipping, bfloat16 built after
    the first forward, FSDP2 mixed precision, 4 steps each bit for bit as torch.optim.AdamW, its
    DTensor state included; a torch.distributed.checkpoint save and load resumes as torch's."""
    outs = launch("hsdp-experts", 4, str(tmp_path))
    for r, out in enumerate(outs):
        for case in ("fp32-clip-apart", "bf16-noclip-late", "fp32-mixed-bf16-clip"):
            assert f"[rank {r}] OK hsdp-experts {case}" in out, out
        assert f"[rank {r}] OK fsdp2-experts dcp" in out, out


def test_transformers_distributed_loading_is_torchs(tmp_path: Path) -> None:
    """transformers' OLMoE and GraniteMoe saved and loaded sharded by transformers itself
    (``from_pretrained(distributed_config=DistributedConfig(...))``): tensor parallel (float32 with
    clipping over DTensors and plain tensors as Trainer clips them; bfloat16 grouped_mm with
    accumulation), FSDP2 with the model's plan (the shared-buffer warning names the fsdp_plan entry)
    and with the experts in a group of their own, expert parallel with FSDP2: 3 steps each bit for
    bit as torch.optim.AdamW on the same loaded model, state_dict included, at most one layer of
    expert gradient shards alive."""
    outs = launch("hf-dist", 2, str(tmp_path))
    for r, out in enumerate(outs):
        for case in ("olmoe-tp-fp32-clip", "granite-tp-bf16-grouped_mm-accum2", "olmoe-fsdp-fp32-clip",
                     "olmoe-fsdp-experts-apart-fp32", "granite-ep-fsdp-fp32-clip"):
            assert f"[rank {r}] OK hf-dist {case}" in out, out


@pytest.mark.skipif(os.environ.get("SONAR_TRANSPORT") == "unix",
                    reason="about transformers' sharding, not the transport: run once, in the ZeroMQ pass (7 min)")
@pytest.mark.timeout(1500)  # each part has its own timeout below; this is the whole on a loaded host
@pytest.mark.parametrize("sharding", ["tp", "ep"])
def test_every_family_transformers_shards_is_torchs(tmp_path: Path, sharding: str) -> None:
    """Every MoE family of the installed transformers whose config carries a tensor-parallel
    (tp) or expert-parallel (ep, with FSDP2 for the rest) plan, saved tiny and loaded sharded by
    transformers on 2 ranks: 2 steps with dense clipping, bit for bit as torch.optim.AdamW on the
    same loaded model. Families whose sharded model fails in transformers itself, with no
    optimizer involved, are skipped; they must stay a small minority. The families run in
    PARTS processes, each a share of them (transformers leaks a sharded model's process groups, and
    one process for all ~70 got slower with each family: see run_hf_dist_families)."""
    ok: list[list[str]] = [[], []]
    skipped: list[list[str]] = [[], []]
    for k in range(PARTS):
        outs = launch("hf-dist-families", 2, str(tmp_path), sharding, f"{k}/{PARTS}", timeout=600)
        for r, out in enumerate(outs):
            lines = out.splitlines()
            ok[r] += [line for line in lines if line.startswith(f"[rank {r}] OK hf-dist-families")]
            skipped[r] += [line for line in lines if line.startswith(f"[rank {r}] SKIP hf-dist-families")]
    for r in range(2):  # each rank on its own: one rank's passes must not carry the other's
        report = "\n".join(ok[r] + skipped[r])
        assert len(ok[r]) >= 10 and len(ok[r]) >= 4 * len(skipped[r]), report
    families = [{line.split()[5] for line in ok[r]} for r in range(2)]
    assert families[0] == families[1], families


PARTS = 4


def test_fsdp1_flattened_experts_are_refused_or_stepped_as_torch() -> None:
    """FSDP1 (FullyShardedDataParallel, use_orig_params True and False) flattens the expert
    tensors into its flat parameters: SonarAdamW warns that it cannot update them (naming FSDP1 and
    what to use) and steps everything as torch's AdamW does, bit for bit over 3 steps with FSDP1's
    own clip_grad_norm_; expert_params= naming them, and max_grad_norm (it would measure a rank's
    own shards), are refused, leaving the parameters as they were. SonarTrainer builds it without
    max_grad_norm there and lets Trainer clip."""
    outs = launch("fsdp1", 2)
    for r, out in enumerate(outs):
        for case in ("use_orig_params=True", "use_orig_params=False", "SonarTrainer clips as Trainer"):
            assert f"[rank {r}] OK fsdp1 {case}" in out, out


def test_hand_over_grad_is_the_hook_update() -> None:
    """SonarAdamW.hand_over_grad (the path the DDP hook uses) makes exactly the hook's update:
    with its hooks removed and every expert gradient handed over by the caller, training stays
    bit for bit equal to torch.optim.AdamW; with max_expert_grad_norm the caller's gradient is
    left alone and the copy is clipped as clip_grad_norm_([p], c) would."""
    cfg = tm.MoEConfig(num_layers=2, num_experts=4, hidden=32, intermediate=48)
    ref, mine = tm.build(cfg, 4), tm.build(cfg, 4)
    experts = set(tm.expert_param_names(ref))
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3)
    data = tm.batches(tm.load_corpus(50_000), 2, 32, torch.Generator().manual_seed(4))
    with sonar_moe.SonarAdamW(mine, lr=2e-3, max_expert_grad_norm=0.01, namespace="unit") as opt:
        opt.remove_grad_hooks()
        assert opt.stats(server=False)["namespace"] == "unit"
        for step in range(3):
            x = next(data)
            loss, _ = ref(x, labels=x)
            loss.backward()
            for n, p in ref.named_parameters():
                if n in experts:
                    torch.nn.utils.clip_grad_norm_([p], 0.01)
            ropt.step()
            ropt.zero_grad()
            loss, _ = mine(x, labels=x)
            loss.backward()
            for n, p in mine.named_parameters():
                if n in experts:
                    assert p.grad is not None  # no hook took it
                    before = p.grad.clone()
                    opt.hand_over_grad(p, p.grad)
                    assert torch.equal(p.grad, before)  # the caller's gradient is not clipped or freed
                    p.grad = None
            opt.step()
            opt.zero_grad()
            for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
                assert torch.equal(a, b), f"step {step + 1}: {n} differs"
        p = next(p for n, p in mine.named_parameters() if n in experts)
        with pytest.raises(ValueError, match="does not match"):
            opt.hand_over_grad(p, torch.zeros(3))
        with pytest.raises(ValueError, match="not an expert"):
            opt.hand_over_grad(mine.lm_head.weight, torch.zeros_like(mine.lm_head.weight))


def test_ignore_experts_in_ddp_names_the_expert_tensors() -> None:
    for layout in ("batched", "modulelist"):
        model = tm.build(tm.MoEConfig(num_layers=2, num_experts=4, hidden=16, intermediate=16, layout=layout), 0)
        names = ignore_experts_in_ddp(model)
        assert names == tm.expert_param_names(model)
        # what DDP reads (a list of names, set by ignore_experts_in_ddp)
        assert set(cast(list[str], model._ddp_params_and_buffers_to_ignore)) == set(names)
