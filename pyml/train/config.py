"""What a training run was asked to do: `TrainingConfig`, its defaults by model form, and its
checks; saved in every checkpoint's state.json, so a resume can compare."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyml.errors import PymlError
from pyml.train.metrics import event_writer_class
from pyml.train.schedule import check_schedule

# Options that fix what a run computes: a resume must use the values the checkpoint was made with.
FIXED_ON_RESUME = ("batch", "seq", "lr", "weight_decay", "max_grad_norm", "seed", "dtype",
                   "train_on", "long_examples", "eval_data", "accumulate", "schedule",
                   "warmup_steps", "min_lr", "packing")
# Defaults that differ by model form: a 135M decoder fine-tunes with small batches and a small
# learning rate; the digits MLP learns from scratch with larger ones.
FORM_DEFAULTS = {
    "decoder": {"batch": 2, "seq": 128, "lr": 1e-4},
    "sequential": {"batch": 64, "seq": None, "lr": 1e-3},
}
COMMON_DEFAULTS = {
    "steps": 200,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "eval_every": 50,
    "eval_batches": 4,
    "checkpoint_every": 100,
    "seed": 0,
    "dtype": "float32",
    "device": "cpu",
    "train_on": "assistant",  # JSONL chats and instructions: the loss on the answers only
    "long_examples": "truncate",
    "accumulate": 1,
    "schedule": "constant",
    "warmup_steps": 0,
    "min_lr": 0.0,
    "packing": True,
}


@dataclass(frozen=True)
class TrainingConfig:
    """Everything a run was asked to do; saved in every checkpoint's state.json."""

    spec: str  # the spec's name
    steps: int  # the step to stop at (counted from the start of the run, across resumes)
    batch: int
    seq: int | None  # tokens per sequence (decoders only)
    lr: float
    weight_decay: float
    max_grad_norm: float  # 0 turns gradient clipping off
    eval_every: int
    eval_batches: int  # held-out batches per evaluation (decoders; the MLP uses all held-out data)
    checkpoint_every: int
    seed: int
    dtype: str
    device: str
    init: str | None = None
    data: str | None = None
    lora: dict | None = None  # the [lora] table --lora-rank added to the spec: rank, alpha, targets
    train_on: str = "assistant"  # JSONL examples: targets on the answers, or on every token ("all")
    long_examples: str = "truncate"  # JSONL examples longer than a window: "truncate" or "drop"
    eval_data: str | None = None  # held-out data; without it a share of --data is held out
    accumulate: int = 1  # batches whose gradients make one optimizer step (--batch rows each)
    schedule: str = "constant"  # the learning rate's schedule (pyml.train.schedule)
    warmup_steps: int = 0
    min_lr: float = 0.0  # where the cosine schedule ends
    log: str | None = None  # "tensorboard": metrics.jsonl's values also as TensorBoard events
    base_weights: str | None = None  # a LoRA run's base_weights_digest of its --init folder
    packing: bool | None = True  # JSONL examples: several to a row, attending within each


def check_config(config: TrainingConfig) -> None:
    for name in ("steps", "batch", "eval_every", "eval_batches", "checkpoint_every"):
        if getattr(config, name) < 1:
            raise PymlError(f"--{name.replace('_', '-')} must be at least 1")
    if config.seq is not None and config.seq < 1:
        raise PymlError("--seq must be at least 1")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise PymlError(f"--lr must be a positive number, got {config.lr}")
    for name in ("weight_decay", "max_grad_norm"):
        value = getattr(config, name)
        if not (value >= 0 and math.isfinite(value)):
            raise PymlError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if config.accumulate is not None and config.accumulate < 1:
        raise PymlError(f"--accumulate must be at least 1, got {config.accumulate}")
    check_schedule(config.schedule or "constant", config.warmup_steps or 0, config.min_lr or 0.0,
                   config.lr, config.steps)
    if config.dtype not in ("float32", "float64"):
        raise PymlError(f"--dtype must be float32 or float64, got {config.dtype}")
    if config.log is not None:
        event_writer_class(config.log)


