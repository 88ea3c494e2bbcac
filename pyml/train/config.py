"""What a training run was asked to do: `TrainingConfig`, its defaults by model form, and its
checks; saved in every checkpoint's state.json, so a resume can compare."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyml.errors import PymlError
from pyml.train.metrics import event_writer_class
from pyml.train.schedule import check_schedule

# Options that fix what a run computes: a resume must use the values the checkpoint was made with.
FIXED_ON_RESUME = ("batch", "seq", "lr", "weight_decay", "max_grad_norm", "seed", "dtype",
                   "train_on", "long_examples", "eval_data", "accumulate", "schedule",
                   "warmup_steps", "min_lr", "packing", "method", "beta", "loss_type")
# Defaults that differ by model form. A decoder is fine-tuned as TRL's SFTTrainer fine-tunes one:
# 3 epochs (transformers' num_train_epochs), learning rate 2e-5 (SFTConfig's default) decaying
# linearly to 0 (transformers' lr_scheduler_type), no warmup (both libraries' default). A constant
# 1e-4 for a fixed 200 steps memorised small data sets: on the README's five chats the held-out
# loss rose from 2.21 to 5.96 in 20 steps. The digits MLP learns from scratch, where a larger
# constant rate for a fixed number of steps is what its stated accuracy was measured with.
FORM_DEFAULTS = {
    "decoder": {"batch": 2, "seq": 128, "lr": 2e-5, "steps": None, "epochs": 3.0,
                "schedule": "linear"},
    "sequential": {"batch": 64, "seq": None, "lr": 1e-3, "steps": 200, "epochs": None,
                   "schedule": "constant"},
}  # fmt: skip
# LoRA trains a few small matrices from zero (B = 0): it takes about ten times full fine-tuning's
# rate, as TRL's and peft's LoRA examples use (2e-4).
LORA_LR = 2e-4
# Preference tuning (--method dpo, orpo) starts from a fine-tuned model and moves it little: TRL's
# DPOConfig and ORPOConfig default to 1e-6; LoRA takes ten times that, as it does for SFT.
PREFERENCE_LR = 1e-6
PREFERENCE_LORA_LR = 1e-5
COMMON_DEFAULTS = {
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
    "warmup_steps": 0,
    "min_lr": 0.0,
    "packing": True,
    "precision": "f32",  # the linear layers' products: f32, or bf16 (pyml.package.bf16_products)
    "recompute": False,  # gradient checkpointing: the same results in less memory, more time
    # every checkpoint is kept, as transformers' save_total_limit=None keeps them: the best one is
    # often not the latest, and a deleted one cannot be had back (--keep N to save the disk)
    "keep": None,
    "method": "sft",  # sft, or a preference method (pyml.train.preference): dpo, orpo
}


@dataclass(frozen=True)
class TrainingConfig:
    """Everything a run was asked to do; saved in every checkpoint's state.json."""

    spec: str  # the spec's name
    # the step to stop at (counted from the start of the run, across resumes); None until
    # `with_steps_for_epochs` has counted the data's rows
    steps: int | None
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
    epochs: float | None = None  # passes over the training rows that gave `steps`; None: --steps
    keep: int | None = None  # checkpoints kept (the newest, and the best evaluated); None: all
    # a decoder's backward runs each block again instead of keeping its activations (None: a
    # checkpoint from before the option, which did not); a resume may change it, as --device
    recompute: bool | None = False
    method: str | None = "sft"  # sft, dpo or orpo (None: a checkpoint from before the option, sft)
    beta: float | None = None  # dpo and orpo: DPO's temperature, ORPO's lambda
    loss_type: str | None = None  # dpo: sigmoid or ipo
    # the linear layers' products: "f32", or "bf16" (operands rounded to bfloat16, float32 sums;
    # the weights, optimizer and every other op float32); None: a checkpoint from before the
    # option, f32. A resume may change it, as --device
    precision: str | None = "f32"

    def objective(self):
        """The preference objective of a dpo or orpo run (`pyml.train.preference.Objective`);
        None for supervised fine-tuning."""
        from pyml.train.preference import Objective

        if self.method in (None, "sft"):
            return None
        return Objective(self.method, self.beta, self.loss_type or "sigmoid")


def steps_for_epochs(epochs: float, rows: int, batch: int, accumulate: int) -> int:
    """Optimizer steps in `epochs` passes over `rows` training rows, as transformers' Trainer
    counts them (`set_initial_training_values`: batches per epoch, the last one partial, rounded
    up to whole optimizer steps of `accumulate` batches, times the epochs, rounded up)."""
    batches_per_epoch = math.ceil(rows / batch)
    steps_per_epoch = max(math.ceil(batches_per_epoch / accumulate), 1)
    return math.ceil(epochs * steps_per_epoch)


def with_steps_for_epochs(config: TrainingConfig, rows: int) -> TrainingConfig:
    """`config` with its steps counted from its epochs and the training data's `rows`."""
    steps = steps_for_epochs(config.epochs, rows, config.batch, config.accumulate or 1)
    config = dataclasses.replace(config, steps=steps)
    check_schedule(config.schedule or "constant", config.warmup_steps or 0, config.min_lr or 0.0,
                   config.lr, steps)
    return config


def check_config(config: TrainingConfig) -> None:
    """Refuse bad options before anything is loaded; steps counted from --epochs are checked
    against the schedule once the data are (`with_steps_for_epochs`)."""
    from pyml.package.base import check_precision

    for name in ("steps", "batch", "eval_every", "eval_batches", "checkpoint_every", "keep"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise PymlError(f"--{name.replace('_', '-')} must be at least 1")
    if config.epochs is not None and not (config.epochs > 0 and math.isfinite(config.epochs)):
        raise PymlError(f"--epochs must be a positive number, got {config.epochs}")
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
    if config.steps is not None:
        check_schedule(config.schedule or "constant", config.warmup_steps or 0,
                       config.min_lr or 0.0, config.lr, config.steps)
    if config.dtype not in ("float32", "float64"):
        raise PymlError(f"--dtype must be float32 or float64, got {config.dtype}")
    check_precision(config.precision or "f32", config.dtype, config.device)
    if config.log is not None:
        event_writer_class(config.log)
    if config.method not in (None, "sft"):
        config.objective()  # refuses a bad --method, --beta or --loss-type
    elif config.beta is not None or config.loss_type is not None:
        raise PymlError("--beta and --loss-type set a preference loss: give --method dpo or orpo")


