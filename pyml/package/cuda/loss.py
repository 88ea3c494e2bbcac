"""loss (CUDA): softmax cross-entropy over the rows, targets of -100 ignored, as
pyml.package.cpu.loss. One block per row, float64 shared-memory trees for the max and the sum of
exponentials; the per-row losses go to a device buffer that the host sums in order
(deterministic). Optional row weights replace the mean's 1 / n_valid in the gradient, and
`target_log_probs` gives each row's log-probability of its target (the row kernel's loss without
a gradient, negated), as the CPU module's say."""

import math

import numpy as np
from numba import cuda

from pyml.package.cpu.loss import IGNORED_TARGET

THREADS = 256
# per-row losses, one float64 device buffer per row count, allocated on first use
ROW_LOSS = {}


@cuda.jit
def row_kernel(logits, targets, dlogits, row_weights, write_grad, row_loss):
    partial = cuda.shared.array(THREADS, np.float64)
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n_classes = logits.shape[1]
    target = targets[n]
    if target == IGNORED_TARGET:
        if write_grad:
            for c in range(tid, n_classes, THREADS):
                dlogits[n, c] = 0.0
        if tid == 0:
            row_loss[n] = 0.0
        return
    row_max = -math.inf
    for c in range(tid, n_classes, THREADS):
        row_max = max(row_max, np.float64(logits[n, c]))
    partial[tid] = row_max
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            partial[tid] = max(partial[tid], partial[tid + stride])
        cuda.syncthreads()
        stride //= 2
    row_max = partial[0]
    cuda.syncthreads()
    total = 0.0
    for c in range(tid, n_classes, THREADS):
        total += math.exp(np.float64(logits[n, c]) - row_max)
    partial[tid] = total
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = partial[0]
    target_logit = np.float64(logits[n, target])
    cuda.syncthreads()  # every thread has read logits[n, target] before dlogits (maybe logits) is written
    if tid == 0:
        row_loss[n] = math.log(total) + row_max - target_logit
    if write_grad:
        weight = row_weights[n]
        scale = weight / total
        for c in range(tid, n_classes, THREADS):
            grad = math.exp(np.float64(logits[n, c]) - row_max) * scale
            if c == target:
                grad -= weight
            dlogits[n, c] = grad


def counted_targets(logits, targets):
    host_targets = targets.copy_to_host()
    if ((host_targets != IGNORED_TARGET) & ((host_targets < 0) | (host_targets >= logits.shape[1]))).any():
        raise ValueError("target out of range of the classes (-100 ignores a row)")
    return int(np.count_nonzero(host_targets != IGNORED_TARGET))


def row_buffer(n_rows):
    # one float64 device buffer per row count, allocated on first use
    if n_rows not in ROW_LOSS:
        ROW_LOSS[n_rows] = cuda.device_array(n_rows, dtype=np.float64)
    return ROW_LOSS[n_rows]


def run(logits, targets, dlogits, write_grad, token_weights=None):
    n_rows = logits.shape[0]
    n_valid = counted_targets(logits, targets)
    row_loss = row_buffer(n_rows)
    if token_weights is None:
        token_weights = uniform_weights(n_rows, 1.0 / n_valid if n_valid else 0.0)
    row_kernel[n_rows, THREADS](logits, targets, dlogits, token_weights, write_grad, row_loss)
    loss_sum = 0.0
    for value in row_loss.copy_to_host():
        loss_sum += float(value)
    return loss_sum / n_valid if n_valid else math.nan


def uniform_weights(n_rows, weight):
    # the mean's row weights, one float64 device buffer per row count
    key = ("uniform", n_rows)
    if key not in ROW_LOSS:
        ROW_LOSS[key] = cuda.device_array(n_rows, dtype=np.float64)
    ROW_LOSS[key].copy_to_device(np.full(n_rows, weight))
    return ROW_LOSS[key]


def loss_forward_backward(logits, targets, dlogits, token_weights=None):
    # the mean loss over non-ignored rows (nan when all are ignored); dlogits (maybe logits
    # itself) is overwritten: (softmax - onehot) / n_valid, or times token_weights[n] where given
    # ((N,) float64 on the device), zeros on ignored rows
    return run(logits, targets, dlogits, True, token_weights)


def loss_forward(logits, targets):
    # the loss alone
    return run(logits, targets, logits, False)


def target_log_probs(logits, targets, log_probs):
    # log_probs (N,) float64 on the device := each row's log-probability of its target
    # (0 on ignored rows): the loss kernel's per-row -log p without a gradient, negated
    counted_targets(logits, targets)
    row_kernel[logits.shape[0], THREADS](logits, targets, logits, log_probs, False, log_probs)
    log_probs.copy_to_device(-log_probs.copy_to_host())
