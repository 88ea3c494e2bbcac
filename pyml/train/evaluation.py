"""The held-out evaluation of a training run: the mean loss (and a classifier's accuracy) over the
held-out rows, in float64 numpy from the model's logits."""

from __future__ import annotations

import numpy as np

from pyml.package.base import IGNORED_TARGET
from pyml.train.config import TrainingConfig


def evaluate(model, held_out_pairs: tuple[np.ndarray, np.ndarray], config: TrainingConfig) -> dict:
    """Mean held-out cross-entropy over a fixed set of held-out rows, from forward passes only
    (the gradients are left alone); classifiers also get their accuracy. Decoders use the first
    `eval_batches` batches of the held-out sequences, classifiers every held-out example."""
    inputs, targets = held_out_pairs
    if config.seq is None:
        batch_size, batch_count = len(inputs), 1
    else:
        batch_size = min(config.batch, len(inputs))
        batch_count = min(config.eval_batches, len(inputs) // batch_size)
    loss_sum, counted, correct = 0.0, 0, 0
    for index in range(batch_count):
        rows = slice(index * batch_size, (index + 1) * batch_size)
        batch_loss_sum, batch_counted, batch_correct = cross_entropy_sum(
            model.forward(inputs[rows]), targets[rows]
        )
        loss_sum, counted, correct = (
            loss_sum + batch_loss_sum, counted + batch_counted, correct + batch_correct
        )  # fmt: skip
    evaluation = {"loss": loss_sum / counted}
    if config.seq is None:
        evaluation["accuracy"] = correct / counted
    return evaluation


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
    """(summed cross-entropy in nats, targets counted, argmax hits) of `logits` (..., classes)
    against integer `targets` (...), skipping IGNORED_TARGET; log-softmax shifted by each row's
    maximum so that no exponential overflows."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    kept = targets != IGNORED_TARGET
    logits, targets = logits[kept], targets[kept]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_normalisers = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))
    losses = log_normalisers - shifted[np.arange(len(targets)), targets]
    hits = int((logits.argmax(axis=1) == targets).sum())
    return float(losses.sum()), len(targets), hits


def describe_evaluation(evaluation: dict) -> str:
    text = f"step {evaluation['step']}: held-out loss {evaluation['loss']:.4f}"
    if "accuracy" in evaluation:
        text += f", accuracy {evaluation['accuracy']:.4f}"
    return text


