"""Learning-rate schedules against transformers' own, gradient accumulation against the large
batch (float64), and the run's metrics.jsonl: every step's learning rate and gradient norm, and a
resumed run continuing the schedule exactly."""

from __future__ import annotations

import json
import signal
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from pyml.errors import PymlError
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train.config import TrainingConfig, check_config
from pyml.train.loop import run_training
from pyml.train.metrics import METRICS_FILE
from pyml.train.schedule import learning_rate
from tests.support.project_packages import project_package

llama = project_package("llama_tiny")
STEPS, LR = 20, 3e-3


def config(**changes) -> TrainingConfig:
    values = dict(spec="llama_tiny", steps=STEPS, batch=2, seq=16, lr=LR, weight_decay=0.01,
                  max_grad_norm=1.0, eval_every=4, eval_batches=1, checkpoint_every=4, seed=0,
                  dtype="float64", device="cpu")  # fmt: skip
    return TrainingConfig(**{**values, **changes})


def transformers_rates(schedule: str, warmup: int, min_lr: float) -> list[float]:
    """The learning rate torch's AdamW runs each of the run's steps at, under transformers'
    scheduler stepped after each optimizer step."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    if schedule == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
    elif schedule == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, STEPS)
    else:
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, STEPS, min_lr=min_lr)
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule, warmup, min_lr", [
    ("constant", 0, 0.0), ("constant", 5, 0.0), ("linear", 0, 0.0), ("linear", 5, 0.0),
    ("cosine", 0, 0.0), ("cosine", 5, 3e-4), ("cosine", 20, 1e-4),
])  # fmt: skip
def test_every_steps_learning_rate_is_transformers(schedule, warmup, min_lr):
    ours = [learning_rate(config(schedule=schedule, warmup_steps=warmup, min_lr=min_lr), step)
            for step in range(1, STEPS + 1)]
    assert ours == pytest.approx(transformers_rates(schedule, warmup, min_lr), rel=1e-15, abs=0)


@pytest.mark.parametrize("changes, message", [
    (dict(schedule="exponential"), "--schedule must be one of constant, linear, cosine"),
    (dict(warmup_steps=-1), "--warmup-steps must not be negative"),
    (dict(warmup_steps=21), "--warmup-steps 21 is more than the run's 20 steps"),
    (dict(schedule="linear", min_lr=1e-4), "--min-lr is where the cosine schedule ends"),
    (dict(schedule="cosine", min_lr=1.0), "--min-lr must be a finite number between 0 and --lr"),
    (dict(accumulate=0), "--accumulate must be at least 1"),
])  # fmt: skip
def test_bad_schedules_are_refused(changes, message):
    with pytest.raises(PymlError, match=message):
        check_config(config(**changes))


def batch(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, llama.model.VOCAB, (rows, 12))
    targets = rng.integers(0, llama.model.VOCAB, (rows, 12))
    targets[0, :10] = IGNORED_TARGET  # slices with different numbers of counted targets
    targets[3, 2:] = IGNORED_TARGET
    return inputs, targets


def test_accumulated_slices_make_the_large_batchs_update():
    """Each slice weighted by its share of the counted targets: the large batch's losses and
    weights to 1e-12 over five AdamW steps, where averaging the slices' means would not be."""
    large, accumulated = (llama.Model.initialized(seed=0, dtype=np.float64) for _ in range(2))
    optimizers = [llama.AdamW(model, lr=1e-2, max_grad_norm=1.0) for model in (large, accumulated)]
    for step in range(5):
        inputs, targets = batch(6, step)
        expected = llama.train_step(large, optimizers[0], inputs, targets)
        got = llama.train_step(accumulated, optimizers[1], inputs, targets, slices=3)
        assert got == pytest.approx(expected, rel=1e-12)
        # to 1e-12 of the largest weight (AdamW divides tiny gradients by their tiny moments, so
        # single near-zero entries differ relatively more)
        difference = np.abs(accumulated.params.flat - large.params.flat).max()
        assert difference <= 1e-12 * np.abs(large.params.flat).max()
    # the check can tell: the mean of the slices' means is another loss
    inputs, targets = batch(6, 99)
    slice_means = [large.loss_and_grads(inputs[a:a + 2], targets[a:a + 2]) for a in (0, 2, 4)]
    assert abs(np.mean(slice_means) - large.loss_and_grads(inputs, targets)) > 1e-3


@pytest.fixture(scope="module")
def pairs():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, llama.model.VOCAB, (24, 17))
    return (ids[:20, :-1], ids[:20, 1:]), (ids[20:, :-1], ids[20:, 1:])


def run(pairs, out, cfg, resume=False):
    model = llama.Model.initialized(seed=0, dtype=np.float64)
    return run_training(llama, model, *pairs, cfg, out, resume=resume, progress=False)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def test_max_grad_norm_0_turns_clipping_off(pairs, tmp_path):
    """--max-grad-norm 0 is no clipping, as a limit the gradients never reach is, not a limit of 0
    (which would scale every gradient to nothing)."""
    losses = {limit: run(pairs, tmp_path / str(limit), config(steps=4, max_grad_norm=limit)).train_losses
              for limit in (0.0, 1e9, 1e-3)}
    assert losses[0.0] == losses[1e9]
    assert losses[1e-3] != losses[1e9]  # clipping changes this run's losses: the check can tell


def test_metrics_record_each_steps_rate_and_a_resumed_schedule_continues_exactly(pairs, tmp_path):
    cfg = config(schedule="cosine", warmup_steps=3, min_lr=3e-4, steps=8, accumulate=2, batch=1)
    straight = run(pairs, tmp_path / "straight", cfg)
    calls = []

    def train_step_stopped_at_4(model, optimizer, inputs, targets, slices, positions=None):
        calls.append(1)
        if len(calls) == 4:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 4: saved, then resumed
        return llama.train_step(model, optimizer, inputs, targets, slices, positions)

    interrupting = SimpleNamespace(AdamW=llama.AdamW, train_step=train_step_stopped_at_4)
    model = llama.Model.initialized(seed=0, dtype=np.float64)
    stopped = run_training(interrupting, model, *pairs, cfg, tmp_path / "halves", progress=False)
    assert stopped.interrupted and stopped.step == 4
    resumed = run(pairs, tmp_path / "halves", cfg, resume=True)
    assert resumed.train_losses == straight.train_losses

    records = [record for record in metrics(tmp_path / "straight") if "loss" in record]
    assert [record["step"] for record in records] == list(range(1, 9))
    assert [record["lr"] for record in records] == [learning_rate(cfg, step) for step in range(1, 9)]
    assert records[0]["lr"] == 0.0 and all(record["grad_norm"] > 0 for record in records)
    assert [record["loss"] for record in records] == straight.train_losses
    evaluations = [record for record in metrics(tmp_path / "straight") if "held_out_loss" in record]
    assert [(e["step"], e["held_out_loss"]) for e in evaluations] == [
        (e["step"], e["loss"]) for e in straight.evaluations]
    # the resumed file: the first half's steps, then the second's, each once
    resumed_steps = [record["step"] for record in metrics(tmp_path / "halves") if "loss" in record]
    assert resumed_steps == list(range(1, 9))
    assert (tmp_path / "straight" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard itself reads from the event files under `folder`, orphans purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_shows_the_metrics_and_a_resume_drops_what_a_crash_logged_past_its_checkpoint(pairs, tmp_path):
    cfg = config(steps=8, log="tensorboard")
    run(pairs, tmp_path / "straight", cfg)
    calls = []

    def train_step_crashing_in_6(model, optimizer, inputs, targets, slices, positions=None):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("power cut")  # step 5 is logged, the last checkpoint is step 4's
        return llama.train_step(model, optimizer, inputs, targets, slices, positions)

    crashing = SimpleNamespace(AdamW=llama.AdamW, train_step=train_step_crashing_in_6)
    model = llama.Model.initialized(seed=0, dtype=np.float64)
    with pytest.raises(RuntimeError, match="power cut"):
        run_training(crashing, model, *pairs, cfg, tmp_path / "crashed", progress=False)
    assert 5 in [step for step, _ in tensorboard_scalars(tmp_path / "crashed" / "tensorboard")["loss"]]
    run(pairs, tmp_path / "crashed", cfg, resume=True)

    def without_rates(out):
        return [{name: value for name, value in record.items() if name != "tokens_per_s"}
                for record in metrics(tmp_path / out)]

    assert without_rates("crashed") == without_rates("straight")  # step 5 once, the resumed run's
    for out in ("straight", "crashed"):
        scalars = tensorboard_scalars(tmp_path / out / "tensorboard")
        expected = {}
        for record in metrics(tmp_path / "straight"):
            for name, value in record.items():
                if name != "step" and value is not None:
                    expected.setdefault(name, []).append((record["step"], value))
        assert sorted(scalars) == sorted(expected) == [
            "grad_norm", "held_out_loss", "loss", "lr", "tokens_per_s"]
        for name in ("loss", "lr", "grad_norm", "held_out_loss"):  # stored as float32
            assert [step for step, _ in scalars[name]] == [step for step, _ in expected[name]]
            np.testing.assert_allclose([v for _, v in scalars[name]], [v for _, v in expected[name]], rtol=1e-6)
    # a fresh run in the same folder starts a fresh log
    run(pairs, tmp_path / "fresh", config(steps=2, log="tensorboard"))
    (tmp_path / "fresh" / "step_000002").rename(tmp_path / "elsewhere")
    run(pairs, tmp_path / "fresh", config(steps=1, log="tensorboard"))
    assert [step for step, _ in tensorboard_scalars(tmp_path / "fresh" / "tensorboard")["loss"]] == [1]


def test_log_names_a_known_writer_and_one_that_is_installed(monkeypatch):
    with pytest.raises(PymlError, match="--log must be one of tensorboard, not 'wandb'"):
        check_config(config(log="wandb"))
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # neither writer importable
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(PymlError, match="--log tensorboard needs tensorboardX"):
        check_config(config(log="tensorboard"))
