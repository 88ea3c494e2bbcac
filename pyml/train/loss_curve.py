"""The loss curve of a training run, `loss.png`: what people expect to read off one.

The training loss of every step, raw (thin) and smoothed (the mean over a window centred on each
step, a fortieth of the run on either side: an average of past steps only, as an exponential
moving average is, would lag behind a falling loss and draw it higher than it is); the held-out
loss at each evaluation, from step 0 (the baseline: the model before its first step); integer
steps on the bottom axis and the tokens (or, for classifiers, the examples) seen so far on the
top one; the run's settings in the title.
"""

from __future__ import annotations

from pathlib import Path

from pyml.errors import PymlError
from pyml.outputs import atomic_write, os_error
from pyml.train.schedule import learning_rate

LOSS_CURVE_FILE = "loss.png"  # in a run's --out folder

# The smoothing window reaches this fraction of the run's steps to either side (at least one).
SMOOTHING_REACH = 1 / 40


def smoothing_reach(steps: int) -> int:
    return max(1, int(steps * SMOOTHING_REACH))


def smoothed(losses: list[float]) -> list[float]:
    """Value i is the mean of losses[i - h : i + h + 1] (h = `smoothing_reach`), the window cut
    short at either end of the run."""
    reach, values = smoothing_reach(len(losses)), []
    for index in range(len(losses)):
        window = losses[max(0, index - reach) : index + reach + 1]
        values.append(sum(window) / len(window))
    return values


def describe_settings(config) -> str:
    """The settings a run (a `TrainingConfig`) trained with, in two lines."""
    start = f"from {config.init}" if config.init else "from fresh weights"
    if config.lora:
        start += (f", LoRA rank {config.lora['rank']} alpha {config.lora['alpha']:g} on "
                  f"{','.join(config.lora['targets'])}")
    rows = f"{config.batch} x {config.seq} tokens" if config.seq else f"{config.batch} examples"
    if (config.accumulate or 1) > 1:
        rows += f", {config.accumulate} accumulated"
    clip = f"clip {config.max_grad_norm:g}" if config.max_grad_norm else "no clipping"
    schedule = config.schedule or "constant"
    if config.warmup_steps:
        schedule += f" after {config.warmup_steps} warmup steps"
    return (
        f"{config.spec} {start}\nbatch {rows}, AdamW lr {config.lr:g} ({schedule}), weight decay "
        f"{config.weight_decay:g}, {clip}, {config.dtype}, seed {config.seed}"
    )


def loss_curve_figure(train_losses: list[float], evaluations: list[dict], config):
    """The matplotlib Figure of the curve (no pyplot: no GUI backend, no global figure state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    per_step = config.batch * (config.accumulate or 1) * (config.seq or 1)
    seen = "tokens seen" if config.seq else "examples seen"
    figure = Figure(figsize=(9, 6.5), layout="constrained")
    axes, rate_axes = figure.subplots(2, 1, sharex=True, height_ratios=(4, 1))
    steps = range(1, len(train_losses) + 1)
    axes.plot(steps, train_losses, linewidth=0.7, alpha=0.45, color="C0", label="train")
    window = 2 * smoothing_reach(len(train_losses)) + 1
    axes.plot(steps, smoothed(train_losses), linewidth=1.8, color="C0",
              label=f"train, mean of the {window} steps around each")  # fmt: skip
    if evaluations:
        axes.plot([e["step"] for e in evaluations], [e["loss"] for e in evaluations], marker="o",
                  color="C1", label="held-out (step 0: before training)")  # fmt: skip
    axes.set_ylabel("cross-entropy (nats)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    last = max([len(train_losses), *(e["step"] for e in evaluations)])
    axes.set_xlim(0, max(last, 1))
    top = axes.secondary_xaxis(
        "top", functions=(lambda step: step * per_step, lambda count: count / per_step)
    )
    top.set_xlabel(seen)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(describe_settings(config), fontsize=9)
    rate_axes.plot(steps, [learning_rate(config, step) for step in steps], color="C2")
    rate_axes.set_ylabel("learning rate")
    rate_axes.set_xlabel("step")
    rate_axes.set_ylim(bottom=0)
    rate_axes.grid(alpha=0.3)
    return figure


def write_loss_curve(
    path: Path, train_losses: list[float], evaluations: list[dict], config
) -> None:
    """Write the curve as a PNG at `path`, atomically."""
    figure = loss_curve_figure(train_losses, evaluations, config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a run that fails before its first save
        atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=100))
    except OSError as error:
        raise PymlError(f"{path}: cannot write the loss curve: {os_error(error)}") from None
