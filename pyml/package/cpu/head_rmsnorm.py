"""head_rmsnorm (QK-norm): every head's head_dim features are one RMSNorm row, with one gain of
head_dim shared by the heads: y[n, h] = x[n, h] * rstd[n, h] * g, rstd[n, h] = 1 / sqrt(mean_i
x[n, h, i]² + eps), g = w or, with a unit offset (Gemma's q_norm and k_norm), 1 + w.

x, y, dy, dx are (N, heads, head_dim) arrays whose last axis is contiguous and whose other strides
are free: views into the fused q/k/v buffer. The gain is element-wise (Lean law hadamard_adjoint);
the normalisation is non-linear: numerics checked against PyTorch and finite differences. As the
RMSNorm kernel: squares summed in float64, rstd stored and used in x's dtype.
"""

import math

import numpy as np
from numba import njit, prange

from pyml.package.cpu.rmsnorm import ROW_CHUNKS, partials
from pyml.package.vector_math import (
    F32_ONE,
    dot_float64,
    unit_offset_weighted_dot_float64,
    weighted_dot_float64,
)


@njit(cache=True, parallel=True)
def head_rmsnorm_forward(x, w, y, rstd, eps, unit_offset):
    # x, y are (N, heads, head_dim) (strided; y may alias x), w is (head_dim,), rstd is (N, heads)
    n_heads, head_dim = x.shape[1], x.shape[2]
    for row in prange(x.shape[0] * n_heads):
        n, h = row // n_heads, row % n_heads
        rstd[n, h] = 1.0 / math.sqrt(dot_float64(x[n, h], x[n, h]) / head_dim + eps)
        r = rstd[n, h]
        if unit_offset:
            for i in range(head_dim):
                y[n, h, i] = (w[i] + F32_ONE) * (x[n, h, i] * r)
        else:
            for i in range(head_dim):
                y[n, h, i] = w[i] * (x[n, h, i] * r)


@njit(cache=True, parallel=True)
def head_rmsnorm_backward_kernel(x, w, rstd, dy, dx, dw, partial, unit_offset):
    n_rows, n_heads, head_dim = x.shape[0], x.shape[1], x.shape[2]
    # dw first: dy is read whole before any dx is written, so dx may alias dy; the heads of a row
    # in order
    rows_per_chunk = (n_rows + ROW_CHUNKS - 1) // ROW_CHUNKS
    for chunk in prange(ROW_CHUNKS):
        acc = partial[chunk]
        acc[:] = 0.0
        for n in range(chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, n_rows)):
            for h in range(n_heads):
                r = rstd[n, h]
                for i in range(head_dim):
                    acc[i] += dy[n, h, i] * (x[n, h, i] * r)
    for i in range(head_dim):
        total = 0.0
        for chunk in range(ROW_CHUNKS):
            total += partial[chunk, i]
        dw[i] = total
    for row in prange(n_rows * n_heads):
        n, h = row // n_heads, row % n_heads
        r = np.float64(rstd[n, h])
        if unit_offset:
            c = r * r * r * unit_offset_weighted_dot_float64(dy[n, h], x[n, h], w) / head_dim
            for i in range(head_dim):
                dx[n, h, i] = r * (w[i] + F32_ONE) * dy[n, h, i] - c * x[n, h, i]
        else:
            c = r * r * r * weighted_dot_float64(dy[n, h], x[n, h], w) / head_dim
            for i in range(head_dim):
                dx[n, h, i] = r * w[i] * dy[n, h, i] - c * x[n, h, i]


def head_rmsnorm_backward(x, w, rstd, dy, dx, dw, unit_offset):
    # in the forward pass this was: y[n, h, i] = g[i] * (x[n, h, i] * rstd[n, h]), g = w or 1 + w,
    # with rstd[n, h] = (sum_j x[n, h, j]² / D + eps)^(-1/2), D = head_dim
    # so now we have, per head as the RMSNorm row backward:
    #   dx[n, h, i] = rstd[n, h] * g[i] * dy[n, h, i] - rstd[n, h]³ / D * x[n, h, i] * sum_j dy[n, h, j] g[j] x[n, h, j]
    # and, the gain being shared by the heads, its gradient sums over them (Lean law hadamard_adjoint):
    #   dw[i] = sum_n sum_h dy[n, h, i] * x[n, h, i] * rstd[n, h]
    # dx (strided as x; it may alias dy) and dw are overwritten.
    head_rmsnorm_backward_kernel(x, w, rstd, dy, dx, dw, partials(x.shape[2]), unit_offset)
