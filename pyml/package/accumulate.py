"""Gradient accumulation: one optimizer step from a batch computed a slice of rows at a time
(`train_step(..., slices)`, `pyml train --accumulate`).

The loss of a step is the mean over the batch's counted targets (those not IGNORED_TARGET; every
row of a classifier's batch), so each slice's mean loss and gradient are weighted by its share
of the batch's counted targets, not by 1 / slices: a slice holding more answer tokens weighs
more, and the update is the large batch's (the normalisation transformers' Trainer got wrong
for years: it averaged the slices' means). Only one slice's activations are in memory at a time;
the gradients add up in one more buffer of the parameters' size.
"""

from __future__ import annotations

import numpy as np

from pyml.package.cpu.loss import IGNORED_TARGET


def loss_and_grads(model, inputs, targets, slices: int = 1, on_grads_ready=None,
                   positions=None) -> float:
    """The batch's mean loss, its gradient in `model.grads`; with `slices` > 1, computed over that
    many consecutive slices of rows. `on_grads_ready(i)` is called for each gradient bucket once it
    is final (with slices, after the last one). A decoder's `positions` (rows packing several
    examples) are sliced with the rows."""

    def rows_loss(rows: slice, hook=None) -> float:
        packed = {} if positions is None else {"positions": positions[rows]}
        return model.loss_and_grads(inputs[rows], targets[rows], on_grads_ready=hook, **packed)

    bounds = [len(inputs) * index // slices for index in range(slices + 1)]
    parts = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    counted = [int(np.count_nonzero(np.asarray(targets[a:b]) != IGNORED_TARGET)) for a, b in parts]
    total = sum(counted)
    if len(parts) == 1 or total == 0:  # the one pass (a batch with nothing counted: its NaN loss)
        return rows_loss(slice(None), on_grads_ready)
    kernels, grads = model.device.kernels, model.grads.flat
    accumulated = getattr(model, "accumulated_grads", None)  # allocated at the first such step
    if accumulated is None:
        accumulated = model.accumulated_grads = model.device.zeros(grads.shape[0])
    loss, first = 0.0, True
    for (a, b), count in zip(parts, counted):
        if not count:
            continue
        share = count / total
        loss += share * rows_loss(slice(a, b))
        kernels.adamw_scale(grads, share)
        if first:
            kernels.copy_into(accumulated, grads)
            first = False
        else:
            kernels.add_into(accumulated, grads)
    kernels.copy_into(grads, accumulated)
    if on_grads_ready is not None:
        for bucket in range(len(model.grad_buckets)):
            on_grads_ready(bucket)
    return loss
