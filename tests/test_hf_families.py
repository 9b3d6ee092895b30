"""Every MoE family of the installed transformers, built tiny from its config: SonarAdamW finds
exactly its expert tensors and trains it bit for bit like torch.optim.AdamW.

The families are discovered (``hf_families.moe_families``), so a newer transformers brings its
new families in. What each family's expert tensors are is not taken from ``sonar_moe``:
transformers declares them itself in the config's expert-parallel plan (``base_model_ep_plan``:
the tensors it shards across ranks with ``grouped_gemm``); for the families without a plan the
expectation is written down here (``LAYOUTS``). A new family without either fails, on purpose:
someone has to look at its layout.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import sonar_moe
from conftest import sonard_command
from hf_families import EXPERTS, Family, build, inputs, loss_of, model_class, moe_families

LR = 3e-3
WD = 0.05
CLIP = 1e-3  # small enough that clipping engages on every step
STEPS = 2  # the second step reads the moments back

# Expert tensors of the families whose config has no expert-parallel plan (regexes on names).
LAYOUTS: dict[str, list[str]] = {
    "dbrx": [r"\.ffn\.experts\.mlp\.(w1|v1|w2)"],                       # flattened [E * I, H]
    "doge": [r"\.mlp\.(down|up)_embed\.weight"],                        # one expert per embedding row
    "jetmoe": [r"\.mlp\.(input|output)_linear\.weight",                 # MLP experts
               r"\.self_attention\.experts\.(input|output)_linear\.weight"],  # attention experts
    "llama4_text": [r"\.feed_forward\.experts\.(gate_up|down)_proj"],
    "longcat_flash": [r"\.mlp\.experts\.(gate_up|down)_proj"],
    "nllb-moe": [r"\.ffn\.experts\.expert_\d+\.fc[12]\.(weight|bias)"],  # per-expert modules
    "switch_transformers": [r"\.mlp\.experts\.expert_\d+\.w[io]\.weight"],
    "vitpose_backbone": [r"\.mlp\.experts\.\d+\.(weight|bias)"],           # ModuleList of Linear
}

FAMILIES = moe_families()


def _patterns(family: Family) -> list[str]:
    plan = getattr(family.config_class, "base_model_ep_plan", None) or {}
    sharded = [k for k, v in plan.items() if v == "grouped_gemm"]
    if sharded:
        return [re.escape(k).replace(r"\*", r"\d+") for k in sharded]
    if family.model_type in LAYOUTS:
        return LAYOUTS[family.model_type]
    pytest.fail(f"{family.model_type}: no expert-parallel plan in its config and no entry in LAYOUTS; look at its "
                "layout, add it to LAYOUTS (and to docs/models.md)")


def expected_experts(family: Family, model: nn.Module) -> list[str]:
    """The expert tensors of ``model`` by transformers' own account (or LAYOUTS), in module order."""
    pats = [re.compile(r"(^|\.)" + p.lstrip(r"\.") + "$") for p in _patterns(family)]
    return [n for n, _ in model.named_parameters() if any(p.search(n) for p in pats)]


def _id(f: Family) -> str:
    return f.model_type


@pytest.fixture(scope="module")
def server(sonard_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sonard for every family (a private one per optimizer would cost a process start each)."""
    addr = f"ipc://{tmp_path_factory.mktemp('families')}/sonard.sock"
    proc = subprocess.Popen(sonard_command(sonard_binary, addr, "--log-level", "warn"))
    yield addr
    proc.terminate()
    assert proc.wait(timeout=10) == 0


@pytest.fixture(autouse=True)
def _reproducible() -> Iterator[None]:
    """Deterministic kernels (some expert kernels accumulate in parallel in no fixed order on CPU,
    see hf_util) and one torch thread: on busy shared cores two OpenMP threads wait on each other
    (a tiny model's step measured 100x slower). The reference and the Sonar run alike."""
    # (fill_uninitialized_memory is a property of torch.utils.deterministic's module class: torch's
    # typing does not show it)
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True, warn_only=True)
    # NaN-filling every new tensor costs time
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def test_families_are_discovered() -> None:
    names = {f.model_type for f in FAMILIES}
    # the layouts of issue 17 and the ones the README names are all among them
    assert {"olmoe", "granitemoe", "mixtral", "dbrx", "jetmoe", "switch_transformers", "nllb-moe", "doge",
            "gpt_oss", "qwen2_moe", "deepseek_v3"} <= names
    assert len(names) >= 30


@pytest.mark.parametrize("family", FAMILIES, ids=_id)
def test_detection_and_bitwise_training(family: Family, server: str) -> None:
    if model_class(family) is None:
        pytest.fail(f"{family.model_type}: no model class for {family.config_class.__name__}")
    ref = build(family, seed=7)
    mine = copy.deepcopy(ref)
    want = expected_experts(family, mine)
    assert want, f"{family.model_type}: the tiny model has no expert tensor (are its MoE layers switched on?)"

    found = sonar_moe.find_experts(mine)
    assert list(found) == want, f"detected {sorted(set(found) ^ set(want))} differently"
    for name, t in found.items():
        p = mine.get_parameter(name)
        if t.layout == "per-expert":
            assert t.experts == 1
        else:
            assert t.experts >= EXPERTS and p.shape[0] % t.experts == 0, (name, t, tuple(p.shape))

    before = {n: mine.get_parameter(n).detach().clone() for n in want}
    dense = [p for n, p in ref.named_parameters() if n not in found]
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    with sonar_moe.SonarAdamW(mine, lr=LR, weight_decay=WD, max_grad_norm=CLIP, server=server) as opt:
        assert [n for n, _ in opt.named_expert_parameters()] == want
        assert len(opt.dense_parameters()) == len(dense)
        for step in range(STEPS):
            batch = inputs(ref, step)
            loss_of(ref, batch, step).backward()
            norm = torch.nn.utils.clip_grad_norm_(dense, CLIP)
            ropt.step()
            ropt.zero_grad()

            loss_of(mine, batch, step).backward()
            for n in want:
                assert mine.get_parameter(n).grad is None, f"{n}: expert gradient kept after backward"
            opt.step()
            opt.zero_grad()

            assert opt.last_dense_grad_norm is not None, f"step {step + 1}: no dense gradient norm"
            assert torch.equal(opt.last_dense_grad_norm, norm), f"step {step + 1}: dense gradient norm differs"
            for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters(), strict=True):
                assert torch.equal(a, b), f"step {step + 1}: {n} differs (max {(a - b).abs().max().item():.3e})"
        st = opt.stats()
        assert st["grads_sent"] > 0 and st["server"]["errors"] == 0
        # a backward after step() with no zero_grad(): refused before anything changes, seen
        # through the dense gradients the step applied (sonar_moe/_zeroing.py), in every family
        loss_of(mine, inputs(ref, STEPS), STEPS).backward()
        opt.step()
        kept = {n: p.detach().clone() for n, p in mine.named_parameters()}
        with pytest.raises(RuntimeError, match="were not zeroed"):
            loss_of(mine, inputs(ref, STEPS + 1), STEPS + 1).backward()
        assert all(torch.equal(kept[n], p) for n, p in mine.named_parameters()), "the refused backward changed a tensor"
    moved = [n for n in want if not torch.equal(before[n], mine.get_parameter(n))]
    assert moved, "no expert tensor was updated"


# ------------------------------------------------------------------- detection details
@pytest.mark.parametrize("name,shape,expert", [
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 32), True),           # batched
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 64), True),          # gpt-oss expert bias
    ("transformer.blocks.0.ffn.experts.mlp.w1", (64, 32), True),              # DBRX, flattened
    ("model.layers.0.mlp.input_linear.weight", (4, 64, 32), True),            # JetMoe MLP experts
    ("model.layers.0.self_attention.experts.output_linear.weight", (4, 32, 16), True),  # JetMoe attention
    ("encoder.block.0.layer.1.mlp.experts.expert_3.wi.weight", (32, 32), True),  # Switch-Transformers
    ("model.decoder.layers.0.ffn.experts.expert_0.fc1.bias", (32,), True),    # NLLB-MoE
    ("layers.1.moe.experts.2.down.weight", (16, 24), True),                   # ModuleList
    ("model.layers.0.self_attention.experts.router.layer.weight", (4, 32), False),
    ("model.layers.0.self_attention.experts.bias", (32,), False),
    ("model.layers.0.mlp.shared_experts.gate_proj", (1, 16, 32), False),      # Inkling's shared expert
    ("model.layers.0.mlp.router.weight", (4, 32), False),
    ("layers.0.mlp.experts.post_expert_norm.weight", (4096,), False),         # MuseSpark: shared by all experts
])
def test_detection_by_name(name: str, shape: tuple[int, ...], expert: bool) -> None:
    """Without the module (``(name, param)`` pairs), the names of the transformers layouts decide."""
    assert sonar_moe.is_expert_param(name, torch.empty(shape)) is expert


def test_find_experts_counts_come_from_module_and_config() -> None:
    """A flattened [E * I, H] tensor: E from the experts module or, failing that, the config."""

    class Flat(nn.Module):
        def __init__(self, n: int | None) -> None:
            super().__init__()
            if n is not None:
                self.num_experts = n
            self.w1 = nn.Parameter(torch.randn(12, 5))      # 2-D, 12 rows
            self.norm = nn.Parameter(torch.randn(12))       # 1-D: shared by the experts

    class Block(nn.Module):
        def __init__(self, n: int | None) -> None:
            super().__init__()
            self.router = nn.Linear(5, 3)
            self.experts = Flat(n)

    found = sonar_moe.find_experts(Block(3))
    assert {n: (t.layout, t.experts) for n, t in found.items()} == {"experts.w1": ("flattened", 3)}
    block = Block(None)
    assert sonar_moe.find_experts(block) == {}  # no count anywhere: a 2-D tensor is not known to be experts
    block.config = type("Cfg", (), {"text_config": type("Text", (), {"n_routed_experts": 4})()})()
    found = sonar_moe.find_experts(block)
    assert {n: (t.layout, t.experts) for n, t in found.items()} == {"experts.w1": ("flattened", 4)}


def test_no_experts_warns_and_trains_as_adamw() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.warns(sonar_moe.NoExpertsWarning, match="expert_params="):
        opt = sonar_moe.SonarAdamW(model, lr=LR)
    with opt:
        assert opt.server_address is None and opt.named_expert_parameters() == []
        ref = copy.deepcopy(model)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
        for m, o in ((ref, ropt), (model, opt)):
            m(x).pow(2).mean().backward()
            o.step()
        for a, b in zip(ref.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["dbrx", "gpt_oss", "doge"])
def test_split_experts_splits_by_expert_count(model_type: str, server: str) -> None:
    """split_experts=True registers one server tensor per expert: the count found by detection
    (not dim 0 of a flattened [E * I, H] tensor), still bitwise."""
    (family,) = [f for f in FAMILIES if f.model_type == model_type]
    ref = build(family, seed=5)
    mine = copy.deepcopy(ref)
    found = sonar_moe.find_experts(mine)
    assert found and all(t.experts == EXPERTS for t in found.values())
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    with sonar_moe.SonarAdamW(mine, lr=LR, split_experts=True, server=server) as opt:
        batch = inputs(ref, 0)
        loss_of(ref, batch, 0).backward()
        ropt.step()
        loss_of(mine, batch, 0).backward()
        opt.step()
        st = opt.stats()
    assert st["step_requests"] == sum(t.experts for t in found.values())
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters(), strict=True):
        assert torch.equal(a, b), n
