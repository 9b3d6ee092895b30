"""peft LoRA adapters on an MoE model: the adapters stay dense, also where they sit on the
experts module itself (``target_parameters``), so ``max_grad_norm`` clips them with the other
dense parameters. A red team found LoRA's ``lora_A`` [r*E, in] / ``lora_B`` [out, r*E] taken
for flattened experts (updated on the server, never clipped)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

import sonar_moe
from hf_util import text_batches, tiny_olmoe

CLIP = 0.002


def lora_model(target: str, train_experts: bool) -> torch.nn.Module:
    model = tiny_olmoe("eager", seed=0, num_layers=2)
    kw: dict[str, Any] = dict(r=4, lora_alpha=8, lora_dropout=0.0)
    if target == "experts":
        kw.update(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    else:
        kw.update(target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(model, LoraConfig(**kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:  # peft starts B at zero: give every adapter a gradient from the first step
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            if train_experts and (n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")):
                p.requires_grad_(True)
    return peft_model


@pytest.mark.parametrize(("target", "train_experts"), [("experts", False), ("experts", True), ("attention", True)],
                         ids=["lora-on-experts", "lora-on-experts-experts-trained", "lora-on-attention"])
def test_lora_adapters_stay_dense_and_are_clipped(target: str, train_experts: bool) -> None:
    model = lora_model(target, train_experts)
    ref = copy.deepcopy(model)
    found = sonar_moe.find_experts(model)
    assert found and not any("lora_" in n for n in found), sorted(found)
    assert all(v.layout == "batched" for v in found.values())
    experts = set(found)
    rdense = [p for n, p in ref.named_parameters() if p.requires_grad and n not in experts]
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with sonar_moe.SonarAdamW(trainable, model=model, lr=1e-2, weight_decay=0.1, max_grad_norm=CLIP) as opt:
        assert {n for n, _ in opt.named_expert_parameters()} == {n for n in experts if dict(trainable).get(n) is not None}
        for b in text_batches(3, count=3):
            ref(**b).loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(rdense, CLIP)
            ropt.step()
            ropt.zero_grad()
            model(**b).loss.backward()
            opt.step()
            opt.zero_grad()
            assert opt.last_dense_grad_norm is not None and torch.equal(opt.last_dense_grad_norm, norm)
            assert float(norm) > CLIP
        for (n, a), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a, q), f"{n} differs"
