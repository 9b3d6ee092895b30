"""Models with more expert tensors than one request may name (4096, ipc.MaxItems): per-expert
``ModuleList`` layouts have three tensors an expert (transformers 4.x Qwen3-MoE: 128 experts x 3
x 48 layers = 18,432; DeepSeek-V3's own modeling code: 256 x 3 x 58 = 44,544). SonarAdamW was
refused at construction ("register: 12288 tensors (want 1..4096)", a trial with 256 experts
in 16 layers, 2026-12-06). Registration now spans several requests, all or none (``more``,
docs/protocol.md), and so do a skipped step's discard and the leftovers that ``step()`` applies.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sonar_moe
from conftest import server_stats, sonard_command
from sonar_moe import SonarAdamW

HIDDEN, INTER = 4, 2
EXPERTS, LAYERS = 700, 2  # 4,200 expert tensors: two register requests
HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gate(x).softmax(-1)  # every expert gets every token: every expert a gradient
        return x + torch.stack([w[:, e:e + 1] * ex(x) for e, ex in enumerate(self.experts)]).sum(0)


class ManyExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def model_pair() -> tuple[ManyExperts, ManyExperts]:
    torch.manual_seed(0)
    model = ManyExperts()
    return model, copy.deepcopy(model)


def assert_equal(ref: nn.Module, model: nn.Module, where: str) -> None:
    bad = [n for (n, a), b in zip(ref.named_parameters(), model.parameters()) if not torch.equal(a, b)]
    assert not bad, f"{where}: {len(bad)} tensors differ from torch's, first {bad[:3]}"


def test_more_expert_tensors_than_one_request_train_as_torch() -> None:
    """4,200 expert tensors, two micro-batches a step: registered in two requests; a step
    skipped after its first micro-batch drops it on the server (discard, two requests); a step
    whose second micro-batch reaches no expert applies the leftovers in step() (two requests).
    Bit for bit torch's AdamW at every step."""
    model, ref = model_pair()
    ropt = torch.optim.AdamW(ref.parameters(), **HP)
    g = torch.Generator().manual_seed(1)
    with SonarAdamW(model, **HP, grad_accumulation_steps=2) as opt:
        found = sum(1 for _ in opt.named_expert_parameters())
        assert found == EXPERTS * LAYERS * 3
        requests = opt.stats()["step_requests"]
        for s, plan in enumerate(["both", "skip", "both", "first-only"]):
            for o in (ropt, opt):
                o.zero_grad()
            for micro in range(2):
                x = torch.randn(3, HIDDEN, generator=g)
                if micro == 1 and plan == "first-only":
                    # No expert takes part (a backward through the first router alone), so
                    # every expert tensor waits in step() for its second micro-batch.
                    for m in (ref, model):
                        router = m.layers[0]
                        assert isinstance(router, Layer)
                        (router.gate(x).sum() * 0.5).backward()
                    continue
                for m in (ref, model):
                    (m(x) * 0.5).backward()
                if plan == "skip":
                    break
            if plan != "skip":
                ropt.step()
                opt.step()
            assert_equal(ref, model, f"step {s + 1} ({plan})")
        sent = opt.stats()["step_requests"] - requests
        # A request per layer and micro-batch (2 + 1 + 2 + 1 micro-batches reached the experts),
        # and the leftovers of the last step in two (4,200 items; the server refuses more than
        # 4,096 in one, as it refused the skipped step's discard before it was split).
        assert sent == 6 * LAYERS + 2, sent


def test_register_refused_in_its_last_request_leaves_nothing(tmp_path: Path, sonard_binary: str) -> None:
    """A memory budget that holds the first request's states but not all: construction fails
    with the server's reason, and the server holds no tensor of the session (the staged
    ones were dropped with it)."""
    addr = f"ipc://{tmp_path}/sonard.sock"
    per_tensor = 2 * 4 * HIDDEN * INTER  # exp_avg and exp_avg_sq, float32
    budget = per_tensor * 4096 + per_tensor  # room for the first request and one more tensor
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn",
                                           "--max-session-state-bytes", str(budget)))
    try:
        model, _ = model_pair()
        with pytest.raises(sonar_moe.SonarError, match=r"over the memory budget.*staged by earlier register requests"):
            SonarAdamW(model, **HP, server=addr)
        assert server_stats(addr)["tensors"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("batch_bytes", [64 << 20, 3000])
def test_state_dict_round_trip_in_batches_is_torchs(monkeypatch: pytest.MonkeyPatch, batch_bytes: int) -> None:
    """state_dict() and load_state_dict() move the 4,200 tensors' states with many export and
    import requests in flight at once (one round trip per tensor took 3.5 s and 5.8 s for
    12,288 tensors). With the default batch, all in one; with 3,000 bytes, 32 tensors a
    batch (a page of buffers, reused over 132 batches). The dict is torch's, value for
    value; torch's AdamW loaded from it and SonarAdamW loaded from torch's train on equal."""
    from sonar_moe._backend import Transfer
    monkeypatch.setattr(Transfer, "BATCH_BYTES", batch_bytes)
    model, ref = model_pair()
    ropt = torch.optim.AdamW(ref.parameters(), **HP)
    g = torch.Generator().manual_seed(2)
    with SonarAdamW(model, **HP) as opt:
        for _ in range(2):
            x = torch.randn(3, HIDDEN, generator=g)
            for m, o in ((ref, ropt), (model, opt)):
                o.zero_grad()
                m(x).backward()
                o.step()
        mine, torchs = opt.state_dict(), ropt.state_dict()
        assert mine["param_groups"] == torchs["param_groups"]
        assert mine["state"].keys() == torchs["state"].keys()
        for i, st in torchs["state"].items():
            for k, v in st.items():
                assert torch.equal(mine["state"][i][k], v), (i, k)
        # torch's state with its moments scaled, loaded into both: each goes on from it alike
        edited = copy.deepcopy(torchs)
        for st in edited["state"].values():
            st["exp_avg"].mul_(0.5)
        opt.load_state_dict(copy.deepcopy(edited))
        ropt.load_state_dict(edited)
        x = torch.randn(3, HIDDEN, generator=g)
        for m, o in ((ref, ropt), (model, opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
        assert_equal(ref, model, "a step after loading")
        assert opt.state_dict()["state"].keys() == ropt.state_dict()["state"].keys()


def test_load_refused_mid_batch_says_how_far_it_went(monkeypatch: pytest.MonkeyPatch) -> None:
    """sonard refuses one import in the middle of a batch (a buffer reference it does not know,
    put there by the test): every reply of the batch is read, the error says how many tensors'
    states went (all but the refused one) and to load again, nothing else breaks (no reply left
    waiting, the shared buffers given back), and loading again trains on as torch's AdamW."""
    from sonar_moe._backend import Transfer
    model, ref = model_pair()
    ropt = torch.optim.AdamW(ref.parameters(), **HP)
    g = torch.Generator().manual_seed(3)

    def step(models: tuple[tuple[nn.Module, torch.optim.Optimizer], ...]) -> None:
        x = torch.randn(3, HIDDEN, generator=g)
        for m, o in models:
            o.zero_grad()
            m(x).backward()
            o.step()

    with SonarAdamW(model, **HP) as opt:
        step(((ref, ropt), (model, opt)))
        sd = ropt.state_dict()
        body = Transfer._body
        calls = []

        def spoiled(self: Transfer, *args: Any) -> dict[str, Any]:
            b = body(self, *args)
            calls.append(b["tensor"])
            if len(calls) == 1000:
                b["exp_avg"] = {**b["exp_avg"], "seg": 9999}
            return b
        monkeypatch.setattr(Transfer, "_body", spoiled)
        n = EXPERTS * LAYERS * 3
        with pytest.raises(sonar_moe.SonarError, match=rf"after the state of {n - 1} of {n} expert tensors went to "
                                                         r"sonard.*load a state_dict again.*unknown segment"):
            opt.load_state_dict(copy.deepcopy(sd))
        monkeypatch.setattr(Transfer, "_body", body)
        opt.load_state_dict(copy.deepcopy(sd))
        ropt.load_state_dict(sd)
        step(((ref, ropt), (model, opt)))
        assert_equal(ref, model, "a step after loading again")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_split_over_groups_steps_each_tensor_with_its_groups_options(dtype: torch.dtype) -> None:
    """A layer's hooks come one after another, and SonarAdamW makes a step's options and scalars
    once for the tensors whose group, values, dtype and device are the same. Here a
    layer's per-expert tensors alternate between three groups (plain options that differ in one
    value each, and a tensor lr a scheduler changes in place), a LambdaLR changes every lr at
    every step, and one group's betas are changed by hand between steps: each tensor must be
    stepped with its own group's values of that step, bit for bit torch's AdamW."""
    torch.manual_seed(3)
    experts = nn.ModuleList(Expert() for _ in range(12)).to(dtype)
    ref = copy.deepcopy(experts)

    def groups(m: nn.ModuleList) -> list[dict[str, Any]]:
        tensors = [(f"experts.{i}.{n}", p) for i, e in enumerate(m) for n, p in e.named_parameters()]
        return [{"params": tensors[0::3], "lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1},
                {"params": tensors[1::3], "lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1},
                {"params": tensors[2::3], "lr": torch.tensor(1e-2), "betas": (0.9, 0.99), "weight_decay": 0.0}]

    def plain(gs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**g, "params": [p for _, p in g["params"]]} for g in gs]

    ropt = torch.optim.AdamW(plain(groups(ref)), eps=1e-8)
    with SonarAdamW(groups(experts), eps=1e-8, expert_params=lambda name, p: True) as opt:
        assert sum(1 for _ in opt.named_expert_parameters()) == 36
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ropt, opt)]
        g = torch.Generator().manual_seed(4)
        for step in range(4):
            x = torch.randn(5, HIDDEN, generator=g).to(dtype)
            for m, o in ((ref, ropt), (experts, opt)):
                o.zero_grad()
                torch.stack([e(x) for e in m]).float().pow(2).mean().backward()
                o.step()
            for s in scheds:
                s.step()
            if step == 1:
                for o in (ropt, opt):
                    o.param_groups[0]["betas"] = (0.8, 0.99)
            assert_equal(ref, experts, f"{dtype} step {step + 1}")
