"""The training loop (`run_training`): steps, evaluations, checkpoints, the loss curve, Ctrl-C,
and a resume that continues bit-identically. The tests drive it directly with their own data;
`pyml.train.run.train` builds the data and the model from the command's options first.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from tqdm import tqdm

from pyml.errors import PymlError
from pyml.outputs import remove_stale_temporaries
from pyml.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    refuse_used_run_folder,
)
from pyml.train.config import TrainingConfig
from pyml.train.data import (
    Batches,
    fingerprint,
)
from pyml.train.distributed import SingleProcess
from pyml.train.evaluation import describe_evaluation, evaluate
from pyml.train.loss_curve import LOSS_CURVE_FILE, write_loss_curve
from pyml.train.metrics import Metrics
from pyml.train.preference import PairRows, evaluate_pairs
from pyml.train.schedule import learning_rate

# More passes over the training rows than this and a run is told it will likely memorise them:
# fine-tunes take 1 to 3 epochs (transformers' and TRL's default is 3); the README's old quick
# start, 200 steps of 2 rows over the 2 rows its four training chats pack into, made 200 passes.
MANY_PASSES = 5
# Held-out losses rising this many evaluations in a row: the run is fitting its training
# examples rather than the task (as early stopping's patience counts).
RISES_TO_WARN = 3


@dataclass
class TrainingResult:
    step: int
    train_losses: list[float]  # train_losses[i] is the loss of step i + 1
    evaluations: list[dict]  # {"step", "loss", and "accuracy" for classifiers}
    checkpoint: Path | None
    stopped_by: int | None = None  # the signal that stopped the run early (SIGINT, SIGTERM)

    @property
    def interrupted(self) -> bool:
        return self.stopped_by is not None

    @property
    def exit_status(self) -> int:
        """0, or what a shell reports for the signal (128 + its number: 130, 143), though the run
        saved and exited by itself, so that a script can tell it stopped early."""
        return 0 if self.stopped_by is None else 128 + self.stopped_by


def run_training(
    package: ModuleType,
    model,
    train_pairs: tuple[np.ndarray, np.ndarray],
    held_out_pairs: tuple[np.ndarray, np.ndarray],
    config: TrainingConfig,
    out: Path,
    resume: bool = False,
    progress: bool = True,
    group=None,
    model_files: dict[str, bytes] | None = None,
    objective=None,
) -> TrainingResult:
    """Train `model` (a `package.Model`) on (inputs, targets) rows until step `config.steps`,
    evaluating (first before step 1, the baseline), checkpointing into `out` and writing
    `out/loss.png` as the config says. With `resume`, first restore `out`'s latest checkpoint into
    the model, the optimizer and the data order. Ctrl-C stops after the step in flight and saves
    it; a non-finite loss raises PymlError and keeps the last checkpoint. `group` (default: one
    process) splits each batch across ranks; only its root writes files and shows progress. Each
    checkpoint is a model folder holding `model_files` (`model_folder.folder_files`) beside the
    weights. With a preference `objective` (`pyml.train.preference.Objective`) the rows are pairs
    (`PairRows.arrays()`), and each step and evaluation reports TRL's reward metrics too."""
    out = Path(out)
    group = group or SingleProcess()
    slices = config.accumulate or 1  # gradient accumulation: --batch rows at a time
    group.check_batch(config.batch * slices)
    optimizer = group.optimizer(
        package,
        model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm or None,
    )
    if group.is_root:
        remove_stale_temporaries(out)
    batches = Batches(train_pairs, config.batch * slices, config.seed)
    data_fingerprint = fingerprint(*train_pairs, *held_out_pairs)
    checkpoint = latest_checkpoint(out)
    if resume:
        if checkpoint is None:
            raise PymlError(f"{out}: no checkpoint to resume from; run without --resume to start")
        state = load_checkpoint(checkpoint, model, optimizer)
        if state["data_fingerprint"] != data_fingerprint:
            raise PymlError(
                f"{checkpoint}: the training data differ from the data this run started on "
                "(another --data, --init tokenizer or Python version?); resume on the same data"
            )
        batches.load_state(state["data"])
        step, train_losses, evaluations = state["step"], state["train_losses"], state["evaluations"]
    else:
        refuse_used_run_folder(out)
        step, train_losses, evaluations = 0, [], []
    if group.is_root and (warning := many_passes_warning(config, batches.rows)):
        print(warning)
    metrics = Metrics(out, step if resume else None, config.log) if group.is_root else None

    def save() -> Path:
        state = {
            "step": step,
            "spec": config.spec,
            "config": dataclasses.asdict(config),
            "data": batches.state(),
            "data_fingerprint": data_fingerprint,
            "train_losses": train_losses,
            "evaluations": evaluations,
        }
        saved = group.save_checkpoint(out, model, optimizer, state, model_files)
        if group.is_root:
            write_loss_curve(out / LOSS_CURVE_FILE, train_losses, evaluations, config)
        return saved

    # a pair is two sequences of --seq places: its chosen and its rejected answer
    examples_per_step = config.batch * slices * (config.seq or 1) * (1 if objective is None else 2)
    unit = "tok/s" if config.seq else "examples/s"
    # The first step of a run also compiles the kernels and allocates the buffers: the rate
    # shown leaves it out once there are others.
    seconds_timed, steps_timed, first_step_of_run = 0.0, 0, step + 1
    with (
        tqdm(total=config.steps, initial=step, disable=not (progress and group.is_root),
             unit="step") as bar,
        stop_requested_by_ctrl_c(bar) as stop,
        closing(metrics) if metrics is not None else nullcontext(),
    ):
        def held_out_evaluation() -> dict:
            if objective is None:
                return evaluate(model, held_out_pairs, config)
            return evaluate_pairs(model.target_log_probs, PairRows(*held_out_pairs), objective, config.batch)

        if step == 0 and group.is_root:
            baseline = {"step": 0, **held_out_evaluation()}
            evaluations.append(baseline)
            metrics.evaluation(baseline)
            bar.write(describe_evaluation(baseline))
        while step < config.steps:
            rows = batches.next_batch()
            optimizer.lr = learning_rate(config, step + 1)
            started = time.perf_counter()
            pair_metrics = {}
            try:
                if objective is None:
                    inputs, targets, *packed = rows  # packed: JSONL rows' positions
                    loss = group.train_step(package, model, optimizer, inputs, targets, stop, slices,
                                            packed[0] if packed else None)
                else:
                    preference = group.preference_step(model, optimizer, PairRows(*rows), objective, stop,
                                                       slices)
                    loss, pair_metrics = preference.loss, preference.metrics()
            except PymlError as error:
                if group.is_root:
                    write_loss_curve(out / LOSS_CURVE_FILE, train_losses, evaluations, config)
                # the same class: an error every rank agreed on stays one (GroupError)
                raise type(error)(
                    f"training stopped at step {step + 1}: {error}; {last_good(checkpoint)}"
                ) from None
            seconds = time.perf_counter() - started
            step += 1
            train_losses.append(loss)
            if step == first_step_of_run:
                rate = examples_per_step / seconds
            else:
                seconds_timed, steps_timed = seconds_timed + seconds, steps_timed + 1
                rate = examples_per_step * steps_timed / seconds_timed
            accuracy = (f", reward accuracy {pair_metrics['rewards/accuracies']:.2f}"
                        if pair_metrics else "")
            bar.set_postfix_str(f"loss {loss:.4f}{accuracy}, {rate:,.0f} {unit}", refresh=False)
            bar.update()
            if group.is_root:
                metrics.step(step, loss, optimizer.lr, optimizer.grad_norm, rate,
                             "tokens_per_s" if config.seq else "examples_per_s", pair_metrics)
            if stop.requested:
                checkpoint = save()
                return TrainingResult(step, train_losses, evaluations, checkpoint, stop.signum)
            if group.is_root and (step % config.eval_every == 0 or step == config.steps):
                evaluation = {"step": step, **held_out_evaluation()}
                evaluations.append(evaluation)
                metrics.evaluation(evaluation)
                bar.write(describe_evaluation(evaluation))
                if warning := rising_loss_warning(evaluations):
                    bar.write(warning)
            if step % config.checkpoint_every == 0 or step == config.steps:
                checkpoint = save()
    return TrainingResult(step, train_losses, evaluations, checkpoint)


def many_passes_warning(config: TrainingConfig, rows: int) -> str | None:
    """A warning when the run's steps pass over its `rows` training rows more than MANY_PASSES
    times (the last rows of an epoch that fill no batch wait for the next epoch's order)."""
    rows_per_step = config.batch * (config.accumulate or 1)
    passes = config.steps * rows_per_step / rows
    if passes <= MANY_PASSES:
        return None
    return (f"warning: {config.steps} steps of {rows_per_step} rows pass over the {rows} training "
            f"rows {passes:.1f} times; a model shown so few examples so often memorises them (its "
            "held-out loss rises): train fewer --steps or --epochs, or on more data")


def rising_loss_warning(evaluations: list[dict]) -> str | None:
    """A warning when the held-out loss has risen RISES_TO_WARN or more evaluations in a row."""
    rises = 0
    while rises + 1 < len(evaluations) and evaluations[-rises - 1]["loss"] > evaluations[-rises - 2]["loss"]:
        rises += 1
    if rises < RISES_TO_WARN:
        return None
    start, best = evaluations[-rises - 1], min(evaluations, key=lambda evaluation: evaluation["loss"])
    return (f"warning: the held-out loss rose {rises} evaluations in a row, from {start['loss']:.4f} "
            f"at step {start['step']} to {evaluations[-1]['loss']:.4f}: the model is memorising its "
            f"training examples; the lowest was {best['loss']:.4f} at step {best['step']} (lower "
            "--lr, train fewer --steps or --epochs, or on more data)")


def last_good(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "no checkpoint was written yet; lower --lr or --max-grad-norm and start again"
    return (
        f"the last good checkpoint, {checkpoint}, is kept; lower --lr or --max-grad-norm "
        "and continue from it with --resume"
    )


class StopRequest:
    signum: int | None = None  # the stop signal received, if any

    @property
    def requested(self) -> bool:
        return self.signum is not None


@contextmanager
def stop_requested_by_ctrl_c(bar: tqdm, signals=(signal.SIGINT, signal.SIGTERM)):
    """While inside, Ctrl-C or SIGTERM sets `.signum` instead of raising KeyboardInterrupt in the middle of a step (where the
    weights may be half updated); the loop then saves the finished step and returns. A second one
    aborts at once, keeping the last checkpoint."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be installed from the main thread
        return

    def request_stop(signum, frame):
        stop.signum = signum
        signal.signal(signum, previous[signum])
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        bar.write(f"{name}: saving a checkpoint after this step ({name} again to abort without it)")

    previous = {signum: signal.signal(signum, request_stop) for signum in signals}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def describe_result(result: TrainingResult, out: Path) -> str:
    if result.interrupted:
        name = "Ctrl-C" if result.stopped_by == signal.SIGINT else signal.Signals(result.stopped_by).name
        head = f"stopped by {name} after step {result.step}"
    else:
        head = f"trained to step {result.step}"
    if result.evaluations and not result.interrupted:
        head += f"; {describe_evaluation(result.evaluations[-1]).split(': ', 1)[1]}"
    lines = [head]
    if result.checkpoint is not None:
        lines.append(f"checkpoint: {result.checkpoint}")
        lines.append(f"loss curve: {out / LOSS_CURVE_FILE}")
    if result.interrupted:
        lines.append("continue with the same command and --resume")
    return "\n".join(lines)


