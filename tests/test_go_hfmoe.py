"""The Go OLMoE (train/hfmoe, through cmd/sonar-hfcheck) against transformers.

Each case builds a tiny OlmoeForCausalLM from a config (no download), saves it with
save_pretrained, runs transformers' fp32 eager forward and backward on a batch, and runs the Go
model on the same checkpoint and batch. Logits and loss must agree within 1e-5 relative and
every parameter's gradient within 1e-4 relative (max |go - torch| / max |torch| per tensor).
The Go side also writes the checkpoint back; from_pretrained must load it with no missing,
unexpected or mismatched keys and no warning, and every weight must be bit-for-bit the original.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GraniteMoeConfig, OlmoeConfig, PreTrainedModel

if TYPE_CHECKING:
    from transformers import GenerationMixin

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM.from_pretrained returns (transformers annotates it so too), with
        generate as these tests call it: without return_dict_in_generate it returns the token ids.
        (transformers types generate's self as a protocol that PreTrainedModel does not meet for mypy.)"""

        def generate(self, *args: Any, **kwargs: Any) -> torch.LongTensor: ...

ROOT = Path(__file__).resolve().parents[1]

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def go_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cmd/sonar-hfcheck and cmd/sonar-train, built once with scripts/build-go."""
    out = tmp_path_factory.mktemp("gobin")
    subprocess.run([str(ROOT / "scripts" / "build-go"), "-o", str(out), "sonar-hfcheck", "sonar-train"],
                   cwd=ROOT, check=True)
    return out


def tiny_config(arch: str = "olmoe", **kw: Any) -> OlmoeConfig | GraniteMoeConfig:
    base: dict[str, Any] = dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.1, pad_token_id=1, eos_token_id=2, bos_token_id=None)
    if arch == "granitemoe":
        # Granite-3.1-3B-A800M's multipliers.
        base.update(num_local_experts=8, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.015625, logits_scaling=6.0)
        base.update(kw)
        return GraniteMoeConfig(**base)
    base.update(num_experts=8)
    base.update(kw)
    return OlmoeConfig(**base)


def eager_model(cfg: OlmoeConfig | GraniteMoeConfig, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager").float()


def rel(go: torch.Tensor, ref: torch.Tensor) -> float:
    return ((go.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def load_quietly(path: Path, caplog: pytest.LogCaptureFixture) -> CausalLM:
    """from_pretrained(path) in eager mode; asserts nothing is missing, unexpected or mismatched
    and that transformers logged no warning."""
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            # with output_loading_info=True, from_pretrained returns (model, info): its annotation says the model only
            model, info = cast("tuple[CausalLM, dict[str, Any]]", AutoModelForCausalLM.from_pretrained(
                path, output_loading_info=True, attn_implementation="eager", experts_implementation="eager"))
    finally:
        logger.removeHandler(caplog.handler)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    return model


CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (architecture, config overrides, how the checkpoint is written)
    "gqa": ("olmoe", {}, "save_pretrained"),
    "norm_topk_aux_mha": ("olmoe", dict(norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.1,
                                        num_key_value_heads=4), "save_pretrained"),
    "tied_mqa_sharded": ("olmoe", dict(tie_word_embeddings=True, num_key_value_heads=1, num_experts_per_tok=3),
                         "sharded"),
    "batched_keys": ("olmoe", {}, "batched"),
    "bf16": ("olmoe", dict(output_router_logits=True), "bf16"),
    "granite": ("granitemoe", {}, "save_pretrained"),
    "granite_tied_aux_sharded": ("granitemoe", dict(tie_word_embeddings=True, output_router_logits=True,
                                                    router_aux_loss_coef=0.1), "sharded"),
    "granite_batched_keys": ("granitemoe", {}, "batched"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_go_matches_transformers(case: str, go_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    arch, overrides, layout = CASES[case]
    cfg = tiny_config(arch, **overrides)
    model = eager_model(cfg)
    ck = tmp_path / "ck"
    if layout == "save_pretrained":
        model.save_pretrained(ck)
    elif layout == "sharded":
        model.save_pretrained(ck, max_shard_size="20KB")
        assert (ck / "model.safetensors.index.json").exists()
    elif layout == "batched":
        # The v5 module's own names: one [E, 2I, H] and one [E, H, I] tensor per layer.
        model.save_pretrained(ck)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ck / "model.safetensors"),
                  metadata={"format": "pt"})
    elif layout == "bf16":
        # A bfloat16 checkpoint; the reference is the fp32 model holding exactly its values (not
        # model.to(bfloat16).float(), which would round the rotary inv_freq buffer as well).
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        # (transformers' PreTrainedModel.to is @wraps(nn.Module.to): mypy binds no self, takes dtype for it)
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ck)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
    assert cfg.pad_token_id is not None  # tiny_config sets it
    ids[0, 3] = cfg.pad_token_id  # the padding row of the embedding gets no gradient
    labels = ids.clone()
    labels[1, 5] = -100
    save_file({"input_ids": ids, "labels": labels}, str(tmp_path / "in.safetensors"))

    out = model(input_ids=ids, labels=labels)
    out.loss.backward()

    saved = tmp_path / "saved"
    subprocess.run([str(go_bin / "sonar-hfcheck"), "--model", str(ck), "--inputs", str(tmp_path / "in.safetensors"),
                    "--out", str(tmp_path / "out.safetensors"), "--save", str(saved)], check=True)
    res = load_file(str(tmp_path / "out.safetensors"))

    logits_err = rel(res["logits"], out.logits.detach())
    loss_err = abs(res["loss"].item() - out.loss.item()) / abs(out.loss.item())
    assert logits_err <= LOGITS_RTOL
    assert loss_err <= LOGITS_RTOL
    if cfg.output_router_logits:
        assert abs(res["aux"].item() - out.aux_loss.item()) <= LOGITS_RTOL * abs(out.aux_loss.item())
    names = set()
    worst = 0.0
    for name, p in model.named_parameters():
        names.add(name)
        assert p.grad is not None, name
        err = rel(res["grad." + name], p.grad)
        assert err <= GRAD_RTOL, (name, err)
        worst = max(worst, err)
    assert names == {k[len("grad."):] for k in res if k.startswith("grad.")}
    # The figures of docs/go-trainer.md's table (pytest -s shows them).
    print(f"\n{case}: logits {logits_err:.1e}, loss {loss_err:.1e}, worst gradient {worst:.1e}")

    back = load_quietly(saved, caplog)
    ref = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, ref[name]), name


@pytest.mark.parametrize("arch", ["olmoe", "granitemoe"])
def test_go_finetune_roundtrip(arch: str, go_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """HF checkpoint -> sonar-train --hf (a few steps, per-layer expert updates and the keep-all
    baseline, which must end bit-equal) -> from_pretrained: no warning, the loss transformers
    measures on the training pattern fell, and generate runs."""
    cfg = tiny_config(arch, output_router_logits=True)
    ck = tmp_path / "ck"
    eager_model(cfg).save_pretrained(ck)
    g = torch.Generator().manual_seed(2)
    pattern = torch.randint(3, cfg.vocab_size, (24,), generator=g)
    ids = pattern.repeat(40)
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))
    tuned = tmp_path / "tuned"
    res = subprocess.run([str(go_bin / "sonar-train"), "--hf", str(ck), "--tokens", str(tmp_path / "ids.safetensors"),
                          "--out", str(tuned), "--compare", "--steps", "30", "--batch", "4", "--seq-len", "16", "--lr", "1e-2",
                          "--warmup", "3", "--eval-batches", "2", "--log-level", "warn", "--progress", "off"],
                         check=True, capture_output=True, text=True)
    assert "params bitwise equal: yes" in res.stdout, res.stdout
    assert "(1 layer)" in res.stdout and "(2 layers)" in res.stdout, res.stdout

    batch = pattern.repeat(3)[None, :48]
    before = eager_model(cfg)  # the same seed: the original weights
    orig = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager", experts_implementation="eager")
    for (n, a), b in zip(before.state_dict().items(), orig.state_dict().values()):
        assert torch.equal(a, b), n
    after = load_quietly(tuned, caplog)
    with torch.no_grad():
        loss0 = orig(input_ids=batch, labels=batch).loss.item()
        loss1 = after(input_ids=batch, labels=batch).loss.item()
    assert loss1 < 0.75 * loss0, (loss0, loss1)
    changed = [n for (n, a), b in zip(orig.state_dict().items(), after.state_dict().values()) if not torch.equal(a, b)]
    assert any("experts.gate_up_proj" in n for n in changed) and any("self_attn.q_proj" in n for n in changed), changed
    out = after.generate(batch[:, :8], max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 16)


def test_tokenize_finetune_generate(go_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The user's path with a tokenizer: a local BPE tokenizer (trained here, nothing downloaded)
    saved with a tiny OLMoE, scripts/tokenize_hf.py -> sonar-train --hf -> from_pretrained of
    model and tokenizer from the output directory -> generate and decode."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = (Path(logging.__file__)).read_text()[:20000]
    corpus = tmp_path / "text.txt"
    corpus.write_text(text)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import decoders
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    ck = tmp_path / "ck"
    cfg = tiny_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    eager_model(cfg).save_pretrained(ck)
    tok.save_pretrained(ck)

    ids_path = tmp_path / "ids.safetensors"
    subprocess.run([str(Path(sys.executable)), str(ROOT / "scripts" / "tokenize_hf.py"), "--tokenizer", str(ck),
                    "--out", str(ids_path), str(corpus)], check=True)
    ids = load_file(str(ids_path))["input_ids"]
    assert ids.dtype == torch.int64 and ids[-1].item() == tok.eos_token_id
    assert ids[:-1].tolist() == tok.encode(text, add_special_tokens=False)

    tuned = tmp_path / "tuned"
    subprocess.run([str(go_bin / "sonar-train"), "--hf", str(ck), "--tokens", str(ids_path), "--out", str(tuned),
                    "--steps", "20", "--batch", "4", "--seq-len", "32", "--lr", "1e-2", "--warmup", "2",
                    "--log-level", "warn", "--progress", "off"], check=True, capture_output=True)
    model = load_quietly(tuned, caplog)
    tok2 = AutoTokenizer.from_pretrained(tuned)
    prompt = tok2("import logging", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tok2.decode(out[0]), str)


@pytest.mark.parametrize("arch", ["olmoe", "granitemoe"])
def test_go_training_tracks_torch(arch: str, go_bin: Path, tmp_path: Path) -> None:
    """sonar-train --hf and torch (scripts/hf_loss_curve.py's loop: the same windows, LR schedule,
    dense-only clipping and AdamW) from one checkpoint: every step's loss agrees within 2e-4
    (sonar-train prints four decimals), over enough steps at a high LR that a wrong optimizer,
    schedule, clipping or batch order would show."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from hf_loss_curve import go_args, step_losses, train_torch
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cfg = tiny_config(arch)
    ck = tmp_path / "ck"
    eager_model(cfg).save_pretrained(ck)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size, (24,), generator=g).repeat(50)  # a pattern the loss can fall on
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))
    hyper: dict[str, Any] = dict(steps=12, batch=4, seq=16, lr=1e-2, warmup=3, min_frac=0.1, weight_decay=0.01,
                                 max_grad_norm=0.5)
    res = subprocess.run([str(go_bin / "sonar-train"), "--hf", str(ck), "--tokens", str(tmp_path / "ids.safetensors"),
                          "--procs", "1", *go_args(**hyper)], check=True, capture_output=True, text=True)
    go = step_losses(res.stdout)
    assert len(go) == hyper["steps"], res.stdout
    model = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager", experts_implementation="eager")
    ref, _ = train_torch(model, ids, **hyper)
    diffs = [abs(a - b) for a, b in zip(go, ref)]
    assert max(diffs) <= 2e-4, list(zip(go, ref))
    assert ref[-1] < 0.9 * ref[0], ref  # it trained: the schedule and the updates did something
