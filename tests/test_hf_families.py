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

import pytest
import torch
from torch import nn

import sonar_moe
from hf_families import EXPERTS, VOCAB, Family, build, model_class, moe_families

LR = 3e-3
WD = 0.05
CLIP = 1e-3  # small enough that clipping engages on every step
STEPS = 2

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
}

# Families that cannot be trained here, and why.
SKIP: dict[str, str] = {}

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


def batch(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (2, 16), generator=g)
    if type(model).__name__.endswith(("ForCausalLM", "ForConditionalGeneration")):
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, 16), generator=g)}
    return {"input_ids": ids}


def loss_of(model: nn.Module, inputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    """The loss; dropout and random routing (NLLB-MoE's sampled second expert, jitter) draw
    from ``seed``, so the reference and the Sonar model see the same randomness."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model(**inputs)
    if "labels" in inputs:
        return out.loss
    return out.last_hidden_state.float().pow(2).mean()  # a base model: any scalar of its output


def _id(f: Family) -> str:
    return f.model_type


@pytest.fixture(autouse=True)
def _deterministic() -> object:
    """Some expert kernels accumulate in parallel in no fixed order on CPU (see hf_util): make the
    reference and the Sonar run reproducible."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


def test_families_are_discovered() -> None:
    names = {f.model_type for f in FAMILIES}
    # the layouts of issue 17 and the ones the README names are all among them
    assert {"olmoe", "granitemoe", "mixtral", "dbrx", "jetmoe", "switch_transformers", "nllb-moe", "doge",
            "gpt_oss", "qwen2_moe", "deepseek_v3"} <= names
    assert len(names) >= 30


@pytest.mark.parametrize("family", FAMILIES, ids=_id)
def test_detection_and_bitwise_training(family: Family) -> None:
    if family.model_type in SKIP:
        pytest.skip(SKIP[family.model_type])
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
    with sonar_moe.SonarAdamW(mine, lr=LR, weight_decay=WD, max_grad_norm=CLIP) as opt:
        assert [n for n, _ in opt.named_expert_parameters()] == want
        assert len(opt.dense_parameters()) == len(dense)
        for step in range(STEPS):
            inputs = batch(ref, step)
            loss_of(ref, inputs, step).backward()
            norm = torch.nn.utils.clip_grad_norm_(dense, CLIP)
            ropt.step()
            ropt.zero_grad()

            loss_of(mine, inputs, step).backward()
            for n in want:
                assert mine.get_parameter(n).grad is None, f"{n}: expert gradient kept after backward"
            opt.step()
            opt.zero_grad()

            assert torch.equal(opt.last_dense_grad_norm, norm), f"step {step + 1}: dense gradient norm differs"
            for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters(), strict=True):
                assert torch.equal(a, b), f"step {step + 1}: {n} differs (max {(a - b).abs().max().item():.3e})"
        st = opt.stats()
        assert st["grads_sent"] > 0 and st["server"]["errors"] == 0
    moved = [n for n in want if not torch.equal(before[n], mine.get_parameter(n))]
    assert moved, "no expert tensor was updated"
