"""loss: softmax cross-entropy, mean over non-ignored rows of logsumexp(logits[n]) -
logits[n, targets[n]]; targets of -100 are ignored (Hugging Face's convention). No Lean law
(non-linear): numerics checked against PyTorch and finite differences.

A preference loss (DPO, ORPO: `pyml.train.preference`) is a function of the sequences'
log-probabilities, which are sums of the rows' -cross-entropy; its gradient with respect to the
logits is then each row's cross-entropy gradient times a weight of its own, d loss / d CE_n. So
the one kernel takes optional row weights (`token_weights`) in place of the mean's 1 / n_valid,
and `target_log_probs` gives the per-row log-probabilities those weights are computed from."""

import math

import numpy as np
from numba import njit, prange

from pyml.package.vector_math import MAX_LANES, exp_vectorizable, max_value, sum_float64

IGNORED_TARGET = -100  # a target the loss skips, as torch's cross_entropy does
# rows are summed in this many fixed chunks, then the chunks in order: deterministic for any
# thread count
CHUNKS = 64
# Scratch: per-row lanes for the row max (N, MAX_LANES), and for the loss alone the exponentials
# (N, classes), since there logits are left intact. One set per (N, classes, dtype, with_exps),
# allocated on first use, so nothing is allocated in the step.
SCRATCH = {}


@njit(cache=True)
def count_valid(targets, n_classes):
    # targets is (N,) int64
    n_valid = 0
    for n in range(targets.shape[0]):
        if targets[n] != IGNORED_TARGET:
            if targets[n] < 0 or targets[n] >= n_classes:
                raise ValueError("target out of range of the classes (-100 ignores a row)")
            n_valid += 1
    return n_valid


def scratch(n_rows, n_classes, dtype, with_exps):
    key = (n_rows, n_classes, np.dtype(dtype), with_exps)
    if key not in SCRATCH:
        exps = np.empty((n_rows, n_classes), dtype) if with_exps else None
        SCRATCH[key] = (exps, np.empty((n_rows, MAX_LANES), dtype))
    return SCRATCH[key]


@njit(cache=True, parallel=True)
def loss_sum_kernel(logits, targets, exps, lanes, row_weights, write_grad):
    # logits is (N, classes); exps is (N, classes) and may be logits itself: per row it receives
    # exp(logits - row max), each row's sum taken in float64. With write_grad, exps becomes
    # dlogits = (softmax - onehot) * row_weights[n] in place (row_weights (N,) float64: 1 / n_valid
    # for the mean), zeros on ignored rows. lanes is (N, MAX_LANES) scratch. Returns the float64 sum
    # of the row losses logsumexp - target logit.
    in_place = exps.ctypes.data == logits.ctypes.data
    n_rows, n_classes = logits.shape[0], logits.shape[1]
    partial = np.zeros(CHUNKS)
    rows_per_chunk = (n_rows + CHUNKS - 1) // CHUNKS
    for chunk in prange(CHUNKS):
        for n in range(chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, n_rows)):
            target = targets[n]
            x, d = logits[n], exps[n]
            if target == IGNORED_TARGET:
                if write_grad:
                    d[:] = 0.0
                continue
            row_max = max_value(x, lanes[n])
            target_logit = np.float64(x[target])  # read before d, which may be x, is written
            # two loops: in place, a loop reading x and writing d fails LLVM's overlap check and
            # runs scalar (measured 6x slower); over d alone it is vectorized
            if in_place:
                for c in range(n_classes):
                    d[c] = exp_vectorizable(d[c] - row_max)
            else:
                for c in range(n_classes):
                    d[c] = exp_vectorizable(x[c] - row_max)
            total = sum_float64(d)
            if write_grad:
                weight = row_weights[n]
                scale = weight / total
                for c in range(n_classes):
                    d[c] *= scale
                d[target] -= weight
            partial[chunk] += math.log(total) + np.float64(row_max) - target_logit
    loss_sum = 0.0
    for chunk in range(CHUNKS):
        loss_sum += partial[chunk]
    return loss_sum


def loss_forward_backward(logits, targets, dlogits, token_weights=None):
    # logits is (N, classes), targets is (N,) int64, dlogits is (N, classes) and may be logits
    # itself. Returns the mean loss (a Python float; nan when every row is ignored, as torch).
    # dlogits is overwritten: (softmax - onehot) / n_valid, or times token_weights[n] where given
    # ((N,) float64), zeros on ignored rows.
    n_valid = count_valid(targets, logits.shape[1])
    _, lanes = scratch(logits.shape[0], logits.shape[1], logits.dtype, False)
    if token_weights is None:
        token_weights = uniform_weights(logits.shape[0], 1.0 / n_valid if n_valid else 0.0)
    loss_sum = loss_sum_kernel(logits, targets, dlogits, lanes, token_weights, True)
    return loss_sum / n_valid if n_valid else math.nan


def uniform_weights(n_rows, weight):
    # the mean's row weights, in one (N,) float64 buffer per row count (nothing allocated in the step)
    key = ("uniform", n_rows)
    if key not in SCRATCH:
        SCRATCH[key] = np.empty(n_rows)
    SCRATCH[key][:] = weight
    return SCRATCH[key]


def loss_forward(logits, targets):
    # the loss alone (held-out evaluation); logits is (N, classes), targets is (N,) int64
    n_valid = count_valid(targets, logits.shape[1])
    exps, lanes = scratch(logits.shape[0], logits.shape[1], logits.dtype, True)
    loss_sum = loss_sum_kernel(logits, targets, exps, lanes, uniform_weights(logits.shape[0], 0.0), False)
    return loss_sum / n_valid if n_valid else math.nan


@njit(cache=True, parallel=True)
def target_log_probs_kernel(logits, targets, lanes, log_probs):
    # logits is (N, classes), targets (N,) int64, lanes (N, MAX_LANES) scratch; log_probs (N,)
    # float64 receives log softmax(logits[n])[targets[n]], 0 on ignored rows. Logits are not written.
    n_classes = logits.shape[1]
    for n in prange(logits.shape[0]):
        target = targets[n]
        if target == IGNORED_TARGET:
            log_probs[n] = 0.0
            continue
        x = logits[n]
        row_max = max_value(x, lanes[n])
        total = 0.0
        for c in range(n_classes):
            total += math.exp(np.float64(x[c]) - np.float64(row_max))
        log_probs[n] = np.float64(x[target]) - np.float64(row_max) - math.log(total)


def target_log_probs(logits, targets, log_probs):
    # log_probs (N,) float64 := each row's log-probability of its target (0 where ignored): the
    # terms a sequence's log-probability sums, read from the forward's logits before the loss
    # overwrites them with their gradient
    count_valid(targets, logits.shape[1])
    _, lanes = scratch(logits.shape[0], logits.shape[1], logits.dtype, False)
    target_log_probs_kernel(logits, targets, lanes, log_probs)
