"""Learning-rate schedules, as transformers defines them (transformers.optimization):

    constant   get_constant_schedule_with_warmup
    linear     get_linear_schedule_with_warmup
    cosine     get_cosine_with_min_lr_schedule_with_warmup (one half cosine down to --min-lr)

each a factor of the base --lr that rises linearly from 0 over the first --warmup-steps. A
schedule is a function of the step alone, so a resumed run continues it exactly. As with
torch's LambdaLR stepped after every optimizer step, optimizer step k (counted from 1) runs at
the factor of k - 1: the first step of a warmup runs at 0.
"""

from __future__ import annotations

import math

from pyml.errors import PymlError

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(schedule: str, warmup_steps: int, min_lr: float, lr: float, steps: int) -> None:
    if schedule not in SCHEDULES:
        raise PymlError(f"--schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if warmup_steps < 0:
        raise PymlError(f"--warmup-steps must not be negative, got {warmup_steps}")
    if warmup_steps > steps:
        raise PymlError(f"--warmup-steps {warmup_steps} is more than the run's {steps} steps")
    if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise PymlError(f"--min-lr must be a finite number between 0 and --lr {lr}, got {min_lr}")
    if min_lr and schedule != "cosine":
        raise PymlError(f"--min-lr is where the cosine schedule ends; the {schedule} schedule has none")


def factor(schedule: str, step: int, warmup_steps: int, steps: int, min_lr_rate: float) -> float:
    """transformers' lambda at scheduler step `step` (0-based)."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, float(steps - step) / float(max(1, steps - warmup_steps)))
    progress = float(step - warmup_steps) / float(max(1, steps - warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0.0, cosine * (1 - min_lr_rate) + min_lr_rate)


def learning_rate(config, step: int) -> float:
    """The learning rate of optimizer step `step` (counted from 1) of a run with `config`."""
    # a checkpoint from before schedules existed holds None: the constant rate it ran at
    schedule, warmup, min_lr = config.schedule or "constant", config.warmup_steps or 0, config.min_lr or 0.0
    return config.lr * factor(schedule, step - 1, warmup, config.steps, min_lr / config.lr)
