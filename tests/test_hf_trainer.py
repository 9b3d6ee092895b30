"""Hugging Face Trainer with SonarAdamW: the optimizers tuple, SonarTrainer vs a manual loop,
checkpoint resume, and per-tensor expert clipping."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import GraniteMoeConfig, GraniteMoeForCausalLM, OlmoeConfig, OlmoeForCausalLM
from transformers import PreTrainedModel, Trainer, TrainingArguments

import sonar_moe
from sonar_moe.hf import SonarTrainer, load_weights_in_place, unwrap_sonar
from hf_util import Windows

transformers.logging.set_verbosity_error()


def olmoe(seed: int = 0, layers: int = 2) -> OlmoeForCausalLM:
    cfg = OlmoeConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return OlmoeForCausalLM(cfg)


def granite(seed: int = 0, layers: int = 2) -> GraniteMoeForCausalLM:
    """A tiny GraniteMoe with non-unit multipliers (scaled embedding, residual, attention, logits)."""
    cfg = GraniteMoeConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
                           logits_scaling=2.0)
    torch.manual_seed(seed)
    return GraniteMoeForCausalLM(cfg)


MODELS = {"olmoe": olmoe, "granite": granite}


def args(tmp: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(tmp), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=2e-3, weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        # Trainer's default is adamw_torch_fused; expert tensors do not have fused arithmetic yet.
        optim="adamw_torch")
    base.update(kw)
    return TrainingArguments(**base)


def close_sonar(trainer: Trainer) -> None:
    """Closes the SonarAdamW a SonarTrainer built in train() (and so its private sonard)."""
    opt = unwrap_sonar(trainer.optimizer)
    assert opt is not None
    opt.close()


def experts(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if sonar_moe.is_expert_param(n, p)}


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), f"{n} differs by up to {(x - y).abs().max().item():.3e}"


def test_trainer_with_optimizers_tuple_matches_torch_adamw(tmp_path: Path) -> None:
    """Plain Trainer(optimizers=(SonarAdamW, sched)) == Trainer with torch.optim.AdamW."""
    a = args(tmp_path, max_grad_norm=0.0)
    ref, mine = olmoe(), olmoe()
    ropt = torch.optim.AdamW(ref.parameters(), lr=a.learning_rate, weight_decay=a.weight_decay)
    rs = transformers.get_cosine_schedule_with_warmup(ropt, 2, a.max_steps)
    Trainer(model=ref, args=a, train_dataset=Windows(), optimizers=(ropt, rs)).train()
    with sonar_moe.SonarAdamW(mine, lr=a.learning_rate, weight_decay=a.weight_decay,
                              grad_accumulation_steps=a.gradient_accumulation_steps) as opt:
        s = transformers.get_cosine_schedule_with_warmup(opt, 2, a.max_steps)
        Trainer(model=mine, args=a, train_dataset=Windows(), optimizers=(opt, s)).train()
        assert opt.stats()["server"]["errors"] == 0
    assert_same(ref, mine)


class Recording(SonarTrainer):
    """Records every micro-batch exactly as Trainer feeds it to the model."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[dict[str, torch.Tensor], Any]] = []

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.calls.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)


def test_sonar_trainer_equals_manual_loop_with_dense_clipping(tmp_path: Path) -> None:
    a = args(tmp_path, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=2)
    mine, ref = olmoe(), olmoe()
    tr = Recording(model=mine, args=a, train_dataset=Windows())
    tr.train()
    assert a.max_grad_norm == 0.5 and tr.args is a  # the caller's arguments are not changed
    opt = unwrap_sonar(tr.optimizer)
    assert opt is not None and opt.max_grad_norm == 0.5
    logged = [h["dense_grad_norm"] for h in tr.state.log_history if "dense_grad_norm" in h]
    assert len(logged) == a.max_steps
    assert not any("grad_norm" in h for h in tr.state.log_history)  # the global norm is not known
    assert all("sonar_peak_expert_grad_bytes" in h for h in tr.state.log_history if "loss" in h)
    opt.close()

    # The manual loop: torch.optim.AdamW over all params, clip_grad_norm_ over dense params.
    ref.train()
    dense = [p for n, p in ref.named_parameters() if n not in experts(ref)]
    decay = set(tr.get_decay_parameter_names(ref))  # Trainer's decay/no-decay groups
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in ref.named_parameters() if n in decay]},
        {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}]
    ropt = torch.optim.AdamW(groups, lr=a.learning_rate, weight_decay=a.weight_decay)
    sched = transformers.get_scheduler("cosine", ropt, num_warmup_steps=2, num_training_steps=a.max_steps)
    k = a.gradient_accumulation_steps
    assert len(tr.calls) == k * a.max_steps
    norms = []
    for step in range(a.max_steps):
        for inputs, n in tr.calls[step * k:(step + 1) * k]:
            out = ref(**inputs, num_items_in_batch=n)  # Trainer's loss: normalized by the step's token count
            out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(dense, 0.5)))
        ropt.step()
        sched.step()
        ropt.zero_grad()
    assert_same(ref, mine)
    assert logged == pytest.approx(norms, rel=0, abs=0)
    assert max(norms) > 0.5  # the clipping was active

    # Without clipping, dense_grad_norm is still logged: the first step's equals the norm above.
    unclipped = SonarTrainer(model=olmoe(), args=args(tmp_path, max_grad_norm=0.0, max_steps=1), train_dataset=Windows())
    unclipped.train()
    close_sonar(unclipped)
    first = [h for h in unclipped.state.log_history if "loss" in h][0]
    assert first["dense_grad_norm"] == norms[0] and "grad_norm" not in first


def test_sonar_trainer_leaves_training_arguments_alone(tmp_path: Path) -> None:
    """The saved training_args.bin shows the max_grad_norm asked for, and the same arguments
    object gives a stock Trainer afterwards its usual (global) clipping."""
    a = args(tmp_path / "sonar", max_grad_norm=0.5, max_steps=2, save_strategy="steps", save_steps=2)
    before = a.to_dict()
    st = SonarTrainer(model=olmoe(), args=a, train_dataset=Windows())
    st.train()
    close_sonar(st)
    assert a.to_dict() == before
    saved = torch.load(tmp_path / "sonar" / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.max_grad_norm == 0.5
    reused, fresh = olmoe(), olmoe()
    rt = Trainer(model=reused, args=a, train_dataset=Windows())
    rt.train()
    Trainer(model=fresh, args=args(tmp_path / "fresh", max_grad_norm=0.5, max_steps=2), train_dataset=Windows()).train()
    assert_same(fresh, reused)
    assert max(h["grad_norm"] for h in rt.state.log_history if "grad_norm" in h) > 0.5  # it clipped


class LoadWarnings:
    """Collects warnings of transformers' and sonar_moe's loggers (the test module silences
    transformers' below errors; this lets its warnings through while active)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __enter__(self) -> LoadWarnings:
        self._level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_warning()
        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.messages.append(record.getMessage())  # type: ignore[method-assign]
        for name in ("transformers", "sonar_moe"):
            logging.getLogger(name).addHandler(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in ("transformers", "sonar_moe"):
            logging.getLogger(name).removeHandler(self._handler)
        transformers.logging.set_verbosity(self._level)

    def about_keys(self) -> list[str]:
        return [m for m in self.messages if "keys" in m or "tensors" in m]


def default_args(out: Path, **kw: Any) -> TrainingArguments:
    """Default TrainingArguments (optim adamw_torch_fused) but for what a tiny test run needs;
    max_grad_norm=0 since Trainer's global clipping and Sonar's dense clipping differ by design."""
    base: dict[str, Any] = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=6, learning_rate=2e-3,
                max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p, expected[n]), f"{n} differs"


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sonar_trainer_resume_from_checkpoint_is_bitwise(tmp_path: Path, family: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh SonarTrainer (new optimizer, new sonard, another initialisation) resumed from the
    checkpoint of step 3 ends where an uninterrupted stock Trainer ends after 6 steps; the
    checkpoint is loaded in place (no model built with from_pretrained), without warnings."""
    full = MODELS[family]()
    Trainer(model=full, args=default_args(tmp_path / "full"), train_dataset=Windows()).train()
    first = MODELS[family]()
    t1 = SonarTrainer(model=first, args=default_args(tmp_path / "ck", save_strategy="steps", save_steps=3),
                      train_dataset=Windows())
    t1.train()
    close_sonar(t1)
    ck = tmp_path / "ck" / "checkpoint-3"
    assert (ck / "optimizer.pt").exists()

    def no_second_model(*a: Any, **kw: Any) -> None:
        raise AssertionError("a second model was loaded with from_pretrained")

    monkeypatch.setattr(type(first), "from_pretrained", no_second_model)
    resumed = MODELS[family](seed=123)  # different init: everything must come from the checkpoint
    t2 = SonarTrainer(model=resumed, args=default_args(tmp_path / "ck", save_strategy="steps", save_steps=3),
                      train_dataset=Windows())
    with LoadWarnings() as warned:
        t2.train(resume_from_checkpoint=str(ck))
    close_sonar(t2)
    assert warned.about_keys() == []
    assert_same(full, resumed)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_load_best_model_at_end_restores_experts(tmp_path: Path, family: str) -> None:
    """load_best_model_at_end with an eval strategy: SonarTrainer and the stock Trainer pick the
    same checkpoint, and SonarTrainer's model ends with all of that checkpoint's tensors, experts
    (saved per expert) and GraniteMoe's renamed router included. The metric picks the worst eval
    loss, so the best checkpoint is the first one, not the last step."""
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
              metric_for_best_model="loss", greater_is_better=True)
    ref = MODELS[family]()
    rt = Trainer(model=ref, args=default_args(tmp_path / "ref", **kw), train_dataset=Windows(),
                 eval_dataset=Windows(n=8, seed=1))
    rt.train()
    mine = MODELS[family]()
    st = SonarTrainer(model=mine, args=default_args(tmp_path / "sonar", **kw), train_dataset=Windows(),
                      eval_dataset=Windows(n=8, seed=1))
    with LoadWarnings() as warned:
        st.train()
    close_sonar(st)
    assert warned.about_keys() == []
    assert rt.state.best_model_checkpoint is not None and st.state.best_model_checkpoint is not None
    assert Path(st.state.best_model_checkpoint).name == Path(rt.state.best_model_checkpoint).name == "checkpoint-2"
    best = type(ref).from_pretrained(rt.state.best_model_checkpoint)  # the stock run's best model
    last = type(ref).from_pretrained(tmp_path / "ref" / "checkpoint-6")
    assert_params(mine, params_of(best))
    assert not any(torch.equal(mine.get_parameter(n), last.get_parameter(n)) for n in experts(mine))


def test_max_expert_grad_norm_is_per_tensor_clipping() -> None:
    """max_expert_grad_norm == clip_grad_norm_([p], c) for each expert tensor: not global clipping."""
    ref, mine = olmoe(3), olmoe(3)
    ex = experts(ref)
    dense = [p for n, p in ref.named_parameters() if n not in ex]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    data = Windows(n=8)
    with sonar_moe.SonarAdamW(mine, lr=1e-3, max_grad_norm=1.0, max_expert_grad_norm=0.01) as opt:
        for i in range(4):
            batch = {k: v.unsqueeze(0) for k, v in data[i].items()}
            ref(**batch).loss.backward()
            clipped = [float(torch.nn.utils.clip_grad_norm_([p], 0.01)) for n, p in ref.named_parameters() if n in ex]
            torch.nn.utils.clip_grad_norm_(dense, 1.0)
            ropt.step()
            ropt.zero_grad()
            mine(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            assert_same(ref, mine)
        assert max(clipped) > 0.01  # the clipping was active
    with pytest.raises(ValueError, match="grad_accumulation_steps"):
        sonar_moe.SonarAdamW(olmoe(), max_expert_grad_norm=1.0, grad_accumulation_steps=2)


@pytest.mark.parametrize("accum", [1, 2])
def test_sonar_trainer_reproduces_trainer_optimizer(tmp_path: Path, accum: int) -> None:
    """SonarTrainer builds Trainer's own optimizer (optim=adamw_torch: torch.optim.AdamW with the
    decay/no-decay groups of get_decay_parameter_names): bit for bit the stock Trainer."""
    a = args(tmp_path, max_grad_norm=0.0, gradient_accumulation_steps=accum)
    ref, mine = olmoe(), olmoe()
    rt = Trainer(model=ref, args=a, train_dataset=Windows())
    rt.train()
    assert rt.optimizer is not None
    groups = rt.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [a.weight_decay, 0.0] and groups[1]["params"]
    st = SonarTrainer(model=mine, args=args(tmp_path, max_grad_norm=0.0, gradient_accumulation_steps=accum),
                      train_dataset=Windows())
    st.train()
    opt = unwrap_sonar(st.optimizer)
    assert opt is not None and [g["weight_decay"] for g in opt.param_groups] == [a.weight_decay, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in groups]
    opt.close()
    assert_same(ref, mine)


def test_sonar_trainer_refuses_other_optimizers(tmp_path: Path) -> None:
    for optim, kw in (("adafactor", {}), ("adamw_torch", {"optim_args": "foo=1"})):
        t = SonarTrainer(model=olmoe(), args=args(tmp_path, optim=optim, **kw), train_dataset=Windows())
        with pytest.raises(ValueError, match="SonarTrainer"):
            t.create_optimizer()


# Found by a red team (2026-12-06): three ordinary Trainer set-ups SonarTrainer got wrong.
class Stream(torch.utils.data.IterableDataset):
    """The first ``n`` rows of Windows as a stream (no length): Trainer then counts steps from
    max_steps and carries each pass's leftover micro-batch into the next pass's first step."""

    def __init__(self, n: int) -> None:
        self.rows = [Windows()[i] for i in range(n)]

    def __iter__(self) -> Any:
        return iter(self.rows)


@pytest.mark.parametrize(("rows", "accum"), [(5, 2), (7, 3)])
def test_stream_with_a_leftover_micro_batch_equals_trainer(tmp_path: Path, rows: int, accum: int) -> None:
    """A step of more micro-batches than gradient_accumulation_steps (Trainer's leftover from the
    end of a stream): SonarTrainer follows Trainer's own decision of which backward ends a step
    (it raised 'received gradient 3 before step()' before)."""
    def make() -> TrainingArguments:
        return args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=accum, max_steps=4,
                    max_grad_norm=0.0)
    ref, mine = olmoe(), olmoe()
    rt = Trainer(model=ref, args=make(), train_dataset=Stream(rows))
    rt.train()
    st = SonarTrainer(model=mine, args=make(), train_dataset=Stream(rows))
    st.train()
    assert st.state.global_step == rt.state.global_step == 4
    opt = unwrap_sonar(st.optimizer)
    assert opt is not None and opt.step_boundary is None  # counted again after train()
    close_sonar(st)
    assert_same(ref, mine)


@pytest.mark.parametrize("how", ["optimizer_cls_and_kwargs", "get_optimizer_cls_and_kwargs"])
def test_trainer_optimizer_cls_and_kwargs_is_followed(tmp_path: Path, how: str) -> None:
    """Trainer(optimizer_cls_and_kwargs=(AdamW, {...})), or a subclass's get_optimizer_cls_and_kwargs:
    the AdamW options asked for, bit for bit the stock Trainer (they were ignored before)."""
    spec = (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.5, 0.6), "eps": 1e-6, "foreach": False})

    class Custom(SonarTrainer):
        @staticmethod
        def get_optimizer_cls_and_kwargs(a: TrainingArguments, model: Any = None) -> tuple[Any, dict[str, Any]]:
            return spec[0], dict(spec[1])

    class CustomStock(Trainer):
        @staticmethod
        def get_optimizer_cls_and_kwargs(a: TrainingArguments, model: Any = None) -> tuple[Any, dict[str, Any]]:
            return spec[0], dict(spec[1])

    ref, mine = olmoe(), olmoe()
    a = args(tmp_path, max_grad_norm=0.0)  # Trainer clips all gradients, SonarTrainer the dense ones only
    if how == "optimizer_cls_and_kwargs":
        rt: Trainer = Trainer(model=ref, args=a, train_dataset=Windows(), optimizer_cls_and_kwargs=spec)
        st: SonarTrainer = SonarTrainer(model=mine, args=a, train_dataset=Windows(), optimizer_cls_and_kwargs=spec)
    else:
        rt, st = CustomStock(model=ref, args=a, train_dataset=Windows()), Custom(model=mine, args=a,
                                                                                 train_dataset=Windows())
    rt.train()
    st.train()
    opt = unwrap_sonar(st.optimizer)
    assert opt is not None and opt.param_groups[0]["betas"] == (0.5, 0.6)
    close_sonar(st)
    assert_same(ref, mine)


def test_trainer_optimizer_cls_and_kwargs_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    for spec in ((torch.optim.SGD, {"lr": 0.1}), (torch.optim.AdamW, {"lr": 1e-3, "capturable": True})):
        t = SonarTrainer(model=olmoe(), args=args(tmp_path), train_dataset=Windows(), optimizer_cls_and_kwargs=spec)
        with pytest.raises(ValueError, match="SGD|capturable"):
            t.create_optimizer()


def test_model_init_closes_the_optimizer_of_the_previous_train(tmp_path: Path) -> None:
    """Trainer(model_init=...) builds a new model and optimizer at each train() (as
    hyperparameter_search does): the previous SonarAdamW, and its private sonard, are closed
    (each train() left one more sonard running before)."""
    st = SonarTrainer(model_init=lambda: olmoe(), args=args(tmp_path, max_steps=2), train_dataset=Windows())
    built = []
    for _ in range(3):
        st.train()
        opt = unwrap_sonar(st.optimizer)
        assert opt is not None
        built.append(opt)
    assert [o.closed for o in built] == [True, True, False]
    assert all(o.server_process is None or o.server_process.poll() is not None for o in built[:2])
    built[-1].close()


# Non-default hyper-parameters on top of the defaults: Trainer's default weight_decay is 0, so
# "decay" is what exercises its decay/no-decay groups.
HYPER: dict[str, dict[str, Any]] = {"default": {}, "decay": {"learning_rate": 2e-3, "weight_decay": 0.01}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("accum", "hyper"), [(1, "default"), (2, "default"), (2, "decay")])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_sonar_trainer_equals_trainer_default_optimizer(tmp_path: Path, family: str, accum: int, hyper: str,
                                                         dtype: torch.dtype) -> None:
    """With default TrainingArguments (optim adamw_torch_fused: torch.optim.AdamW(fused=True) with
    Trainer's decay groups) SonarTrainer ends bit for bit where the stock Trainer does. Only
    max_grad_norm is set (to 0): Trainer clips all gradients, SonarTrainer the dense ones only."""
    def default_args() -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
                                 gradient_accumulation_steps=accum, max_grad_norm=0.0, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, **HYPER[hyper])

    a = default_args()
    assert str(getattr(a.optim, "value", a.optim)) == "adamw_torch_fused"
    # transformers' PreTrainedModel.to is @wraps(nn.Module.to): mypy binds no self, takes dtype for it
    ref, mine = MODELS[family]().to(dtype), MODELS[family]().to(dtype)  # type: ignore[arg-type]
    assert isinstance(ref, PreTrainedModel) and torch.equal(ref.lm_head.weight, mine.lm_head.weight)
    init = {n: p.detach().clone() for n, p in mine.named_parameters()}
    rt = Trainer(model=ref, args=a, train_dataset=Windows())
    rt.train()
    assert rt.optimizer is not None
    assert all(g["fused"] for g in rt.optimizer.param_groups)
    assert [g["weight_decay"] for g in rt.optimizer.param_groups] == [a.weight_decay, 0.0]
    st = SonarTrainer(model=mine, args=default_args(), train_dataset=Windows())
    st.train()
    opt = unwrap_sonar(st.optimizer)
    assert opt is not None and all(g["fused"] for g in opt.param_groups)
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in rt.optimizer.param_groups]
    ex = experts(mine)
    assert len(ex) == 4 and all(mine.get_parameter(n).grad is None for n in ex)  # updated by sonard
    opt.close()
    assert_same(ref, mine)
    for n in ex:  # the run moved most expert elements (bf16 rounds the smallest updates away)
        assert (mine.get_parameter(n) != init[n]).float().mean() > 0.4, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_load_weights_in_place_restores_every_tensor(tmp_path: Path, family: str, dtype: torch.dtype) -> None:
    """A save_pretrained checkpoint (experts saved per expert, GraniteMoe's router renamed) is
    copied into another model's own tensors: every tensor equal, no storage replaced."""
    # transformers' PreTrainedModel.to is @wraps(nn.Module.to): mypy binds no self, takes dtype for it
    src, dst = MODELS[family](seed=1).to(dtype), MODELS[family](seed=2).to(dtype)  # type: ignore[arg-type]
    src.save_pretrained(tmp_path)
    storage = {n: p.data_ptr() for n, p in dst.named_parameters()}
    report = load_weights_in_place(dst, str(tmp_path))
    assert report.missing == [] and report.unexpected == []
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == storage
    assert_same(src, dst)


def test_load_weights_in_place_with_tied_embeddings(tmp_path: Path) -> None:
    cfg = olmoe().config
    cfg.tie_word_embeddings = True
    torch.manual_seed(1)
    src = OlmoeForCausalLM(cfg)
    torch.manual_seed(2)
    dst = OlmoeForCausalLM(cfg)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    src.save_pretrained(tmp_path)
    report = load_weights_in_place(dst, str(tmp_path))
    assert report.missing == [] and report.unexpected == []
    assert_same(src, dst)


def test_sonar_trainer_expert_clipping_logs_global_norm(tmp_path: Path) -> None:
    """sonar_kwargs={"expert_clipping": ...}: the norm over all gradients is logged as grad_norm,
    and each step's expert factor follows from the previous step's norm."""
    a = args(tmp_path, max_grad_norm=0.05, max_steps=3)
    tr = SonarTrainer(model=olmoe(), args=a, train_dataset=Windows(), sonar_kwargs={"expert_clipping": "prev_global"})
    tr.train()
    opt = unwrap_sonar(tr.optimizer)
    assert opt is not None and opt.expert_clipping == "prev_global"
    opt.close()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == a.max_steps
    assert logs[0]["expert_grad_scale"] == 1.0  # no estimate before the first step
    for prev, cur in zip(logs, logs[1:]):
        want = float(torch.clamp(0.05 / (torch.tensor(prev["grad_norm"], dtype=torch.float32) + 1e-6), max=1.0))
        assert cur["expert_grad_scale"] == want < 1.0
    assert all(h["grad_norm"] > h["dense_grad_norm"] for h in logs)


class DenseClipping(Trainer):
    """The stock Trainer clipping the dense parameters only (SonarTrainer's reference)."""

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        dense = [p for n, p in model.named_parameters() if n not in experts(model)]
        return self.accelerator.clip_grad_norm_(dense, self.args.max_grad_norm)


@pytest.fixture
def cuda_like_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate scales the loss with a GradScaler for fp16=True on CUDA only; there is no GPU
    here, so each Accelerator with fp16 gets the CPU GradScaler it would make on CUDA (the same
    class and calls: scale, unscale_ in clip_grad_norm_, step, update; fp16 autocast on CPU)."""
    import accelerate

    made = accelerate.Accelerator.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        made(self, *a, **kw)
        if str(self.state.mixed_precision) == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            self.native_amp = True  # as on CUDA: unscale_gradients (clip_grad_norm_) unscales

    monkeypatch.setattr(accelerate.Accelerator, "__init__", init)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_sonar_trainer_fp16_with_accelerates_grad_scaler(tmp_path: Path, cuda_like_scaler: None, optim: str,
                                                         clip: float) -> None:
    """fp16=True where accelerate makes a GradScaler (every CUDA fp16 run): SonarTrainer hands it
    to SonarAdamW, which unscales each expert gradient as the stock Trainer's path does, and
    ends where the stock Trainer (clipping the dense parameters, as SonarTrainer does) ends.
    Before, SonarTrainer raised "stepped by a GradScaler it was not given" at the first step,
    after the experts were updated with still-scaled gradients."""
    a = args(tmp_path, fp16=True, optim=optim, gradient_accumulation_steps=1, max_steps=4, max_grad_norm=clip)
    ref, mine = olmoe(), olmoe()
    rt = DenseClipping(model=ref, args=a, train_dataset=Windows())
    rt.train()
    assert rt.accelerator.scaler is not None
    st = SonarTrainer(model=mine, args=a, train_dataset=Windows())
    st.train()
    opt = unwrap_sonar(st.optimizer)
    assert opt is not None and opt.grad_scaler is st.accelerator.scaler
    if clip:
        assert opt.last_dense_grad_norm is not None and float(opt.last_dense_grad_norm) > clip  # it clipped
    close_sonar(st)
    assert_same(ref, mine)


def test_sonar_trainer_fp16_scaler_with_accumulation_is_refused(tmp_path: Path, cuda_like_scaler: None) -> None:
    """fp16 loss scaling and accumulation: refused before anything is trained, naming bf16."""
    st = SonarTrainer(model=olmoe(), args=args(tmp_path, fp16=True, gradient_accumulation_steps=2),
                      train_dataset=Windows())
    with pytest.raises(ValueError, match="bf16=True"):
        st.create_optimizer()


def gradient_layers(model: torch.nn.Module) -> list[int]:
    """Hooks on every decoder layer's parameters: the layer of each gradient, in the order
    backward finishes them (read after training; one list over all steps)."""
    seen: list[int] = []
    for name, p in model.named_parameters():
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            p.register_post_accumulate_grad_hook(lambda _p, layer=layer: seen.append(layer))
    return seen


def test_sonar_trainer_torch_compile_keeps_one_layer_of_gradients(tmp_path: Path) -> None:
    """torch_compile=True: a stock Trainer compiles the whole model, whose backward is then one
    graph that gives every gradient at once (measured, docs/results-history.md: SonarAdamW's
    peak was torch's, the expert gradients of every layer alive together). SonarTrainer
    compiles each decoder layer on its own (accelerate's regional compilation), so backward
    finishes the layers' gradients one layer after another, the last layer first, as eager
    backward does; training equals the stock Trainer's, compiled as it compiles."""
    a = args(tmp_path, max_grad_norm=0.0, gradient_accumulation_steps=1, max_steps=3, torch_compile=True,
             torch_compile_backend="aot_eager")
    torch._dynamo.reset()
    ref, mine = olmoe(layers=4), olmoe(layers=4)
    Trainer(model=ref, args=a, train_dataset=Windows()).train()
    torch._dynamo.reset()
    order = gradient_layers(mine)
    trainer = SonarTrainer(model=mine, args=a, train_dataset=Windows())
    trainer.train()
    close_sonar(trainer)
    torch._dynamo.reset()
    assert_same(ref, mine)
    per_step = len(order) // a.max_steps
    assert per_step and len(order) == per_step * a.max_steps
    for s in range(a.max_steps):
        got = order[s * per_step:(s + 1) * per_step]
        assert got == sorted(got, reverse=True), f"step {s + 1}: gradients finished in layer order {got}"
