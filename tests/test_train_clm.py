"""tests/scripts/train_clm.py, a training script written as Hugging Face's examples are, run with
the stock Trainer and with ``--sonar``: the same command line ends bit for bit in the same model,
also when interrupted and resumed, and with ``--load_best_model_at_end``. The model (a tiny
OLMoE), the tokenizer (byte-level BPE trained here) and the text (the Python standard library's
sources) are all local."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import OlmoeConfig, OlmoeForCausalLM, PreTrainedTokenizerFast

import sonar_moe
import tiny_moe

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_clm.py"


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The script as a module, with datasets kept offline and its cache in a temporary folder."""
    cache = tmp_path_factory.mktemp("hf-cache")
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(cache))
    spec = importlib.util.spec_from_file_location("train_clm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the script's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text files, and a model directory with a tiny OLMoE and a BPE tokenizer trained on the text."""
    root = tmp_path_factory.mktemp("clm")
    text = tiny_moe.load_corpus(60_000).decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    cut = int(len(lines) * 0.85)
    (root / "train.txt").write_text("\n".join(lines[:cut]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[cut:]) + "\n")

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([str(root / "train.txt")], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    model_dir = root / "model"
    tok.save_pretrained(model_dir)
    cfg = OlmoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    OlmoeForCausalLM(cfg).save_pretrained(model_dir)
    return root


def command(work: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(work / "model"), "--train_file", str(work / "train.txt"),
            "--validation_file", str(work / "valid.txt"), "--block_size", "32",
            "--output_dir", str(out), "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "8",
            "--max_steps", "6", "--learning_rate", "2e-3", "--weight_decay", "0.01",
            # Trainer clips all gradients, SonarTrainer the dense ones: the same only without clipping.
            "--max_grad_norm", "0",
            "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2",
            "--logging_steps", "1", "--seed", "0", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", *extra]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def stock(script: ModuleType, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The stock Trainer's run: 6 steps, checkpoints and evaluations every 2."""
    out = workdir / "stock"
    summary = script.main(command(workdir, out))
    assert summary["global_step"] == 6 and len(summary["eval_losses"]) == 3
    return out, summary


def test_script_uses_the_default_optimizer(script: ModuleType, workdir: Path) -> None:
    parser = script.HfArgumentParser((script.ModelArguments, script.DataArguments, script.RunArguments,
                                      script.TrainingArguments))
    *_, args = parser.parse_args_into_dataclasses(args=command(workdir, workdir / "unused"))
    assert str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused"


def test_sonar_interrupted_and_resumed_equals_the_stock_run(script: ModuleType, workdir: Path,
                                                            stock: tuple[Path, dict[str, Any]]) -> None:
    ref, ref_summary = stock
    out = workdir / "sonar-resumed"
    first = script.main(command(workdir, out, "--sonar", "--stop_after_step", "2"))
    assert first["global_step"] == 2 and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    assert_same_weights(weights(ref / "checkpoint-2"), weights(out / "checkpoint-2"))
    second = script.main(command(workdir, out, "--sonar", "--resume_from_checkpoint", str(out / "checkpoint-2")))
    assert second["global_step"] == 6
    for step in (4, 6):
        assert_same_weights(weights(ref / f"checkpoint-{step}"), weights(out / f"checkpoint-{step}"))
    assert_same_weights(weights(ref), weights(out))
    assert second["eval_losses"] == ref_summary["eval_losses"]  # step 2's comes from the checkpoint's state


def test_sonar_load_best_model_at_end(script: ModuleType, workdir: Path, stock: tuple[Path, dict[str, Any]]) -> None:
    """The metric picks the highest eval loss, so the best checkpoint is not the last step: the
    saved model must be that checkpoint's, experts included."""
    ref, ref_summary = stock
    out = workdir / "sonar-best"
    summary = script.main(command(workdir, out, "--sonar", "--load_best_model_at_end", "true",
                                  "--metric_for_best_model", "loss", "--greater_is_better", "true"))
    assert summary["eval_losses"] == ref_summary["eval_losses"]
    worst = max(ref_summary["eval_losses"], key=lambda s: ref_summary["eval_losses"][s])
    assert worst != 6 and Path(summary["best_model_checkpoint"]).name == f"checkpoint-{worst}"
    best = weights(ref / f"checkpoint-{worst}")
    assert_same_weights(best, weights(out))
    last = weights(ref)
    expert_keys = [k for k in best if ".experts." in k]
    assert expert_keys and not any(torch.equal(best[k], last[k]) for k in expert_keys)
    assert sonar_moe.__version__  # the Sonar path ran with this package
