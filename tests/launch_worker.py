"""A training script as users launch it: under ``torchrun`` or ``accelerate launch`` (gloo, CPU).

tests/test_launchers.py starts it with the real launchers; nothing here sets up the process
group by hand or tells SonarAdamW about DDP, the launcher's environment does.

    MODES OUT [--configs ACCUM:CLIP,...] [--save-steps N] [--resume STEP] [--crash-rank R]

    trainer: stock Trainer, SonarTrainer, then Trainer(optimizers=(SonarAdamW(...), None)), on the
        same tiny OLMoE and data in this process;
        every parameter bitwise equal, and equal on every rank. --save-steps saves checkpoints;
        --resume STEP (a later launch) resumes SonarTrainer from one and must end where the
        uninterrupted run ended.
    loop: a hand-written accelerate loop (Accelerator, prepare, accumulate, clip), torch AdamW
        then SonarAdamW; bitwise equal after every step.
    node: DDP with SonarAdamW; rank --crash-rank raises at step 2, the others must not hang.
    dcp: DDP with SonarAdamW and with torch AdamW, checkpointed through torch.distributed.checkpoint
        (get_state_dict, dcp.save; into new models: dcp.load, set_state_dict); bitwise equal
        trained, loaded and resumed.
    Every mode checks that all ranks of the node used one sonard, without the script saying so.

The reference for clipping is the one SonarAdamW documents: ``clip_grad_norm_`` over the dense
parameters, then AdamW (a Trainer whose clipping skips the expert tensors).
Prints ``[rank R] OK ...`` lines; exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "pyclient")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sonar_moe  # noqa: E402
import tiny_moe as tm  # noqa: E402
from hf_util import Windows  # noqa: E402

if sys.argv[1:2] not in (["node"], ["dcp"]):  # these need no transformers (and start faster without)
    import transformers
    from transformers import OlmoeConfig, OlmoeForCausalLM, Trainer, TrainingArguments

    from sonar_moe.hf import SonarTrainer, unwrap_sonar
    transformers.logging.set_verbosity_error()
else:
    Trainer = object  # type: ignore[assignment,misc]
torch.set_num_threads(1)
RANK = int(os.environ.get("RANK", "0"))


def say(msg: str) -> None:
    # One write per line: print() writes the newline separately, which an unbuffered stdout
    # (PYTHONUNBUFFERED) makes two system calls, and another rank's output can land in between.
    sys.stdout.write(f"[rank {RANK}] {msg}\n")
    sys.stdout.flush()


def olmoe(seed: int = 0) -> Any:
    cfg = OlmoeConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return OlmoeForCausalLM(cfg)


def dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    experts = sonar_moe.find_experts(model)
    return [p for n, p in model.named_parameters() if n not in experts]


class DenseClipTrainer(Trainer):
    """Stock Trainer and torch AdamW, clipping the dense parameters only (SonarAdamW's reference)."""

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        return self.accelerator.clip_grad_norm_(dense_params(self.accelerator.unwrap_model(model)),
                                                self.args.max_grad_norm)


def check_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    bad = [(n, (a[n].float() - b[n].float()).abs().max().item()) for n in a if not torch.equal(a[n], b[n])]
    if bad:
        raise SystemExit(f"[rank {RANK}] FAIL {what}: {len(bad)} of {len(a)} parameters differ, e.g. {bad[:3]}")


def same_on_all_ranks(params: dict[str, torch.Tensor], what: str) -> None:
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in params.values()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    if not all(torch.equal(out[0], o) for o in out):
        raise SystemExit(f"[rank {RANK}] FAIL {what}: the ranks differ")


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def one_server_per_node(opt: sonar_moe.SonarAdamW) -> None:
    """The launcher started every rank on this host: they all use one sonard, unasked."""
    addrs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(addrs, opt.server_address)
    if len(set(addrs)) != 1 or (opt.server_process is not None):
        raise SystemExit(f"[rank {RANK}] FAIL the ranks of one node use servers {addrs}")


# ------------------------------------------------------------------ Trainer
def trainer_args(out: Path, a: argparse.Namespace, accum: int, clip: float) -> Any:
    return TrainingArguments(
        output_dir=str(out), use_cpu=True, ddp_backend="gloo", optim="adamw_torch", weight_decay=0.01,
        max_grad_norm=clip, per_device_train_batch_size=2, gradient_accumulation_steps=accum,
        max_steps=6, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
        report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, save_only_model=False)


def run_trainer(a: argparse.Namespace, accum: int, clip: float) -> None:
    tag = f"accum{accum}-clip{clip}"
    out = Path(a.out) / tag
    finals = {}
    runs = {"stock": DenseClipTrainer if clip > 0 else Trainer, "sonar": SonarTrainer, "trainer+sonaradamw": Trainer}
    for name, cls in runs.items():
        if a.resume and name != "sonar":
            continue
        model = olmoe()
        args = trainer_args(out / name, a, accum, clip)
        kw: dict[str, Any] = {}
        if name == "trainer+sonaradamw":  # stock Trainer given SonarAdamW, grouped as Trainer groups
            decay = set(Trainer(model=model, args=args).get_decay_parameter_names(model))
            named = list(model.named_parameters())
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            # Trainer clips after backward, when only dense gradients are left: dense-only clipping.
            kw["optimizers"] = (sonar_moe.SonarAdamW(groups, model=model, lr=args.learning_rate,
                                                     grad_accumulation_steps=accum), None)
        t = cls(model=model, args=args, train_dataset=Windows(n=96), **kw)
        resume = str(out / name / f"checkpoint-{a.resume}") if a.resume else None
        t.train(resume_from_checkpoint=resume)
        finals[name] = snapshot(model)
        if name != "stock":
            opt = unwrap_sonar(t.optimizer)
            assert opt is not None
            if opt.ddp_hook is None:
                raise SystemExit(f"[rank {RANK}] FAIL {name} did not take the DDP path")
            st = opt.stats()
            if st["server"]["errors"] or st["grads_sent"] == 0:
                raise SystemExit(f"[rank {RANK}] FAIL stats {st}")
            say(f"{name} hook counts {opt.ddp_hook.counts} grads sent {st['grads_sent']}")
            one_server_per_node(opt)
            opt.close()
    if a.resume:
        # The resumed SonarTrainer ends where the uninterrupted stock Trainer did (its parameters were
        # saved by the earlier launch, after checking them equal to SonarTrainer's). Stock Trainer's own
        # resume is not the reference: transformers 5.23 loads OLMoE's per-expert checkpoint tensors with
        # strict=False and no conversion, so its batched experts keep their initial values.
        straight = torch.load(out / "final.pt")
        check_same(straight, finals["sonar"], "SonarTrainer resumed from checkpoint vs the uninterrupted run")
        same_on_all_ranks(finals["sonar"], "SonarTrainer resumed")
        say(f"OK trainer resumed at step {a.resume} {tag} world {dist.get_world_size()}: "
            f"{len(straight)} parameters bitwise equal to the uninterrupted run")
        return
    check_same(finals["stock"], finals["sonar"], "SonarTrainer vs stock Trainer")
    check_same(finals["stock"], finals["trainer+sonaradamw"], "Trainer(optimizers=(SonarAdamW, None)) vs stock Trainer")
    same_on_all_ranks(finals["sonar"], "SonarTrainer")
    if RANK == 0:
        torch.save(finals["sonar"], out / "final.pt")
    say(f"OK trainer {tag} world {dist.get_world_size()}: {len(finals['sonar'])} parameters bitwise equal")


# ------------------------------------------------------- hand-written accelerate loop
def run_loop(a: argparse.Namespace, accum: int, clip: float) -> None:
    from accelerate import Accelerator
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    if acc.num_processes < 2 or acc.distributed_type.value != "MULTI_CPU":
        raise SystemExit(f"[rank {RANK}] FAIL accelerate runs {acc.distributed_type} x {acc.num_processes}")
    finals = []
    for use_sonar in (False, True):
        model = olmoe()
        kw: dict[str, Any] = dict(lr=3e-3, weight_decay=0.01)
        opt: torch.optim.Optimizer
        if use_sonar:
            opt = sonar_moe.SonarAdamW(model, max_grad_norm=clip or None, **kw)  # as on one process
        else:
            opt = torch.optim.AdamW(model.parameters(), **kw)
        loader = torch.utils.data.DataLoader(Windows(n=96), batch_size=2, shuffle=True,
                                             generator=torch.Generator().manual_seed(1))
        model, opt, loader = acc.prepare(model, opt, loader)
        dense = dense_params(acc.unwrap_model(model))
        trace = []
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients and clip and not use_sonar:
                    acc.clip_grad_norm_(dense, clip)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                trace.append(snapshot(acc.unwrap_model(model)))
        finals.append(trace)
        if use_sonar:
            inner = unwrap_sonar(opt)
            assert inner is not None and inner.ddp_hook is not None, "SonarAdamW did not take the DDP path"
            one_server_per_node(inner)
            inner.close()
        acc.free_memory()
    for i, (x, y) in enumerate(zip(*finals)):
        check_same(x, y, f"accelerate loop step {i + 1}")
    same_on_all_ranks(finals[1][-1], "accelerate loop")
    say(f"OK accelerate-loop accum{accum}-clip{clip} world {acc.num_processes}: {len(finals[1])} steps bitwise")


# ------------------------------------------------------------ one sonard per node
def run_node(a: argparse.Namespace, accum: int, clip: float) -> None:
    """DDP with SonarAdamW on tiny_moe; rank --crash-rank raises at step 3."""
    dist.init_process_group("gloo")
    model = tm.build(tm.MoEConfig(num_layers=2, num_experts=4, hidden=32, intermediate=48), 0)
    opt = sonar_moe.SonarAdamW(model, lr=3e-3)  # server=None: the node's shared sonard
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    one_server_per_node(opt)
    data = tm.batches(tm.load_corpus(50_000), 2, 32, torch.Generator().manual_seed(RANK))
    for step in range(4):
        if step == 2 and RANK == a.crash_rank:
            say(f"crashing on purpose at {time.time():.3f}")
            raise RuntimeError("rank crashed on purpose")
        x = next(data)
        ddp(x, labels=x)[0].backward()
        opt.step()
        opt.zero_grad()
        say(f"step {step + 1}")
    say(f"OK node: {dist.get_world_size()} ranks shared {opt.server_address}")
    opt.close()
    dist.destroy_process_group()


def run_dcp(a: argparse.Namespace, accum: int, clip: float) -> None:
    """DDP, SonarAdamW against torch's AdamW, through a torch.distributed.checkpoint save and load."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moe_util import dcp_load, dcp_save

    dist.init_process_group("gloo")
    cfg = tm.MoEConfig(num_layers=2, num_experts=4, hidden=32, intermediate=48)
    hp: dict[str, Any] = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.99))

    def build(seed: int) -> tuple[DDP, sonar_moe.SonarAdamW, DDP, torch.optim.AdamW]:
        model = tm.build(cfg, seed)
        ref = DDP(tm.build(cfg, seed))
        opt = sonar_moe.SonarAdamW(model, **hp)
        return DDP(model), opt, ref, torch.optim.AdamW(ref.parameters(), **hp)

    def train(ddp: DDP, opt: torch.optim.Optimizer, seed: int) -> None:
        data = tm.batches(tm.load_corpus(50_000), 2, 32, torch.Generator().manual_seed(seed + 100 * RANK))
        for _ in range(3):
            x = next(data)
            ddp(x, labels=x)[0].backward()
            opt.step()
            opt.zero_grad()

    def same(what: str) -> None:
        check_same(snapshot(ref.module), snapshot(model.module), what)
        same_on_all_ranks(snapshot(model.module), what)

    model, opt, ref, ropt = build(1)
    one_server_per_node(opt)
    train(model, opt, 1)
    train(ref, ropt, 1)
    same("trained")
    dcp_save({"sonar": (model, opt), "torch": (ref, ropt)}, Path(a.out))
    opt.close()
    model, opt, ref, ropt = build(7)  # other weights: everything comes from the checkpoints
    dcp_load({"sonar": (model, opt), "torch": (ref, ropt)}, Path(a.out))
    same("loaded")
    train(model, opt, 2)
    train(ref, ropt, 2)
    same("resumed")
    say(f"OK dcp: {dist.get_world_size()} ranks saved, loaded and resumed as torch's AdamW")
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("modes", help="comma-separated: trainer, loop, node, dcp")
    ap.add_argument("out", nargs="?", default="")
    ap.add_argument("--configs", default="1:0", help="comma-separated ACCUM:CLIP pairs, each run in turn")
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", type=int, default=0)
    ap.add_argument("--crash-rank", type=int, default=-1)
    a = ap.parse_args()
    t = time.perf_counter()
    runs = {"trainer": run_trainer, "loop": run_loop, "node": run_node, "dcp": run_dcp}
    for mode in a.modes.split(","):
        for cfg in a.configs.split(","):
            accum, clip = cfg.split(":")
            runs[mode](a, int(accum), float(clip))
    say(f"DONE in {time.perf_counter() - t:.1f} s")
    # Leave without the interpreter's teardown: torch's gloo threads can abort a rank there after
    # every check has passed ("terminate called without an active exception", seen in CI on
    # 2026-12-01; pytorch/pytorch#190489 shows the same message; tests/dist_worker.py does the same).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
