"""TRL's trainers are subclasses of transformers' Trainer; SonarTrainer composes with them as a
mixin (``class SonarSFTTrainer(SonarTrainer, SFTTrainer)``), and the parameters end bit for bit
where the stock TRL trainer leaves them with its default optimizer (``adamw_torch_fused``):
supervised fine-tuning (SFTTrainer: its own tokenization, collator and loss) and preference
tuning (DPOTrainer: a frozen reference model beside the trained one, a loss over chosen and
rejected completions). ``max_grad_norm=0``, as clipping differs by design (SonarTrainer clips
the dense gradients only)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import OlmoeConfig, OlmoeForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import tiny_moe
from sonar_moe.hf import SonarTrainer


class SonarSFTTrainer(SonarTrainer, SFTTrainer):
    pass


class SonarDPOTrainer(SonarTrainer, DPOTrainer):
    pass


@pytest.fixture(scope="module")
def lines() -> list[str]:
    text = tiny_moe.load_corpus(40_000).decode("utf-8", errors="replace")
    return [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 20][:200]


@pytest.fixture(scope="module")
def tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def olmoe(tok: PreTrainedTokenizerFast) -> OlmoeForCausalLM:
    cfg = OlmoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=128, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg)


def common(tmp_path: Path, accumulate: int, bf16: bool) -> dict[str, Any]:
    return dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                gradient_accumulation_steps=accumulate, bf16=bf16, use_cpu=True, report_to=[], save_strategy="no",
                logging_steps=1, max_grad_norm=0.0, seed=0, dataloader_num_workers=0)


def trained(trainer: Any, model: OlmoeForCausalLM) -> dict[str, torch.Tensor]:
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if hasattr(opt, "close"):
        opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(ref: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    assert all(not torch.equal(start[n], ref[n]) for n in start if ".experts." in n), "experts not trained"
    bad = [n for n in ref if not torch.equal(ref[n], mine[n])]
    assert not bad, f"{len(bad)} of {len(ref)} tensors differ from the stock trainer's, first {bad[:3]}"


@pytest.mark.parametrize(("accumulate", "bf16"), [(2, False), (1, True)], ids=["float32-accumulate-2", "bf16-amp"])
def test_sft_trainer_with_sonar_equals_stock(tmp_path: Path, lines: list[str], tokenizer: PreTrainedTokenizerFast,
                                             accumulate: int, bf16: bool) -> None:
    ds = Dataset.from_dict({"text": lines})
    runs = {}
    for name, cls in (("stock", SFTTrainer), ("sonar", SonarSFTTrainer)):
        model = olmoe(tokenizer)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = SFTConfig(**common(tmp_path / name, accumulate, bf16), max_length=48)
        trainer = cls(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
        runs[name] = trained(trainer, model)
        if name == "sonar":
            peak = [h["sonar_peak_expert_grad_bytes"] for h in trainer.state.log_history
                    if "sonar_peak_expert_grad_bytes" in h]
            layer = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if n.startswith("model.layers.0.") and ".experts." in n)
            assert peak and max(peak) <= layer, (peak, layer)
    assert_same(runs["stock"], runs["sonar"], start)


def test_dpo_trainer_with_sonar_equals_stock(tmp_path: Path, lines: list[str],
                                             tokenizer: PreTrainedTokenizerFast) -> None:
    ds = Dataset.from_dict({"prompt": lines[0:40], "chosen": lines[40:80], "rejected": lines[80:120]})
    runs = {}
    for name, cls in (("stock", DPOTrainer), ("sonar", SonarDPOTrainer)):
        model = olmoe(tokenizer)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = DPOConfig(**common(tmp_path / name, 2, False), max_length=64)
        trainer = cls(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=ds,
                      processing_class=tokenizer)
        runs[name] = trained(trainer, model)
    assert_same(runs["stock"], runs["sonar"], start)
