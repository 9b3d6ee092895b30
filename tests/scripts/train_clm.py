#!/usr/bin/env python
"""Causal-LM fine-tuning from text files, the way Hugging Face's example scripts are written:
the command line is parsed by ``HfArgumentParser`` into ``TrainingArguments`` and two small
dataclasses, the text is tokenized and grouped into blocks with ``datasets``, and a ``Trainer``
is built from them. ``--sonar`` makes it a ``SonarTrainer``; everything else is the same.

    python tests/scripts/train_clm.py --model_name_or_path DIR --train_file a.txt \\
        --validation_file b.txt --output_dir out --max_steps 100 [--sonar]

``--stop_after_step N`` ends training after step N as an interruption would (Trainer saves the
checkpoint of that step first when it falls on ``--save_steps``); ``--resume_from_checkpoint``
continues from a checkpoint. Nothing is downloaded: the model and tokenizer are local.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import datasets
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments, default_data_collator)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local directory with config, weights and tokenizer."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where datasets keeps its cache."})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "A text file, one example per line."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file for evaluation."})
    block_size: int = field(default=32, metadata={"help": "Tokens per training example after grouping."})
    preprocessing_num_workers: int | None = field(default=None)


@dataclass
class RunArguments:
    sonar: bool = field(default=False, metadata={"help": "Train with sonar_moe.hf.SonarTrainer instead of Trainer."})
    stop_after_step: int | None = field(default=None, metadata={"help": "End training after this step (tests)."})


class StopAfterStep(TrainerCallback):
    """Ends training after a given step, as an interruption there would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def lm_datasets(model_args: ModelArguments, data_args: DataArguments, tokenizer: Any) -> datasets.DatasetDict:
    """Tokenize the text files and cut the concatenated tokens into blocks of block_size."""
    files = {"train": data_args.train_file}
    if data_args.validation_file:
        files["validation"] = data_args.validation_file
    raw = datasets.load_dataset("text", data_files=files, cache_dir=model_args.cache_dir)

    def tokenize(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["text"])

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"],
                        num_proc=data_args.preprocessing_num_workers, desc="tokenizing")
    block = data_args.block_size

    def group_texts(examples: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // block) * block
        out = {k: [v[i: i + block] for i in range(0, total, block)] for k, v in joined.items()}
        out["labels"] = [ids.copy() for ids in out["input_ids"]]
        return out

    return tokenized.map(group_texts, batched=True, num_proc=data_args.preprocessing_num_workers,
                         desc=f"grouping texts in blocks of {block}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    # transformers types the argument as its DataClassType, a NewType of Any that no dataclass itself matches
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, RunArguments, TrainingArguments))  # type: ignore[arg-type]
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, run_args, training_args = parser.parse_json_file(sys.argv[1])
    else:
        model_args, data_args, run_args, training_args = parser.parse_args_into_dataclasses(
            args=list(argv) if argv is not None else None)
    transformers.set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    lm = lm_datasets(model_args, data_args, tokenizer)

    trainer_class: type[Trainer] = Trainer
    if run_args.sonar:
        from sonar_moe.hf import SonarTrainer

        trainer_class = SonarTrainer
    callbacks: list[TrainerCallback] = [StopAfterStep(run_args.stop_after_step)] if run_args.stop_after_step else []
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=lm["train"],
        eval_dataset=lm["validation"] if "validation" in lm else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
    )
    try:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = dict(result.metrics)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        summary = {"global_step": trainer.state.global_step, "train": metrics,
                   "best_model_checkpoint": trainer.state.best_model_checkpoint,
                   "eval_losses": {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}}
        with open(os.path.join(training_args.output_dir, "run_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary
    finally:
        if run_args.sonar:
            from sonar_moe.hf import unwrap_sonar

            opt = unwrap_sonar(trainer.optimizer)
            if opt is not None:
                opt.close()


if __name__ == "__main__":
    main()
