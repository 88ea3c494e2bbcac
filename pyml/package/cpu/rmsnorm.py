"""rmsnorm: y = x · rstd · g, rstd = 1 / sqrt(mean(x²) + eps) per row, the gain g = w or, with a
unit offset (Gemma's RMSNorm, transformers' Gemma3RMSNorm), 1 + w in the input dtype (F32_ONE is
a float32 1, which keeps float32 arithmetic float32 and is exact in float64).

The gain is element-wise (Lean law hadamard_adjoint); the normalisation is non-linear: numerics
checked against PyTorch (LlamaRMSNorm, Gemma3RMSNorm) and finite differences. The sum of squares
is accumulated in float64 for every input dtype; rstd is stored (and used) in the input dtype, as
LlamaRMSNorm does.
"""

import math

import numpy as np
from numba import njit, prange

from pyml.package.vector_math import (
    F32_ONE,
    dot_float64,
    unit_offset_weighted_dot_float64,
    weighted_dot_float64,
)

# dw is summed over rows in this many fixed row chunks, each in row order into a float64 partial,
# then the partials in order: deterministic for any thread count
ROW_CHUNKS = 8
# the partials (float64 for every dtype), one per width, made once
PARTIALS = {}


def partials(width):
    if width not in PARTIALS:
        PARTIALS[width] = np.empty((ROW_CHUNKS, width))
    return PARTIALS[width]


@njit(cache=True, parallel=True)
def rmsnorm_forward(x, w, y, rstd, eps, unit_offset):
    # x is (N, dim), w is (dim,), y is (N, dim), rstd is (N,) in x's dtype
    dim = x.shape[1]
    for n in prange(x.shape[0]):
        rstd[n] = 1.0 / math.sqrt(dot_float64(x[n], x[n]) / dim + eps)
        r = rstd[n]
        if unit_offset:
            for i in range(dim):
                y[n, i] = (w[i] + F32_ONE) * (x[n, i] * r)
        else:
            for i in range(dim):
                y[n, i] = w[i] * (x[n, i] * r)


@njit(cache=True, parallel=True)
def rmsnorm_forward_residual(x, r, x_out, w, y, rstd, eps, unit_offset):
    # fused: x_out = x + r, then y = rmsnorm(x_out). x, r, x_out, y are (N, dim); x_out may alias x.
    dim = x.shape[1]
    for n in prange(x.shape[0]):
        for i in range(dim):
            x_out[n, i] = x[n, i] + r[n, i]
        rstd[n] = 1.0 / math.sqrt(dot_float64(x_out[n], x_out[n]) / dim + eps)
        s = rstd[n]
        if unit_offset:
            for i in range(dim):
                y[n, i] = (w[i] + F32_ONE) * (x_out[n, i] * s)
        else:
            for i in range(dim):
                y[n, i] = w[i] * (x_out[n, i] * s)


@njit(cache=True, parallel=True)
def rmsnorm_backward_kernel(x, w, rstd, dy, dx, dw, partial, accumulate, unit_offset):
    n_rows, dim = x.shape[0], x.shape[1]
    for n in prange(n_rows):
        r = np.float64(rstd[n])
        if unit_offset:
            c = r * r * r * unit_offset_weighted_dot_float64(dy[n], x[n], w) / dim
            for i in range(dim):
                if accumulate:
                    dx[n, i] += r * (w[i] + F32_ONE) * dy[n, i] - c * x[n, i]
                else:
                    dx[n, i] = r * (w[i] + F32_ONE) * dy[n, i] - c * x[n, i]
        else:
            c = r * r * r * weighted_dot_float64(dy[n], x[n], w) / dim
            for i in range(dim):
                if accumulate:
                    dx[n, i] += r * w[i] * dy[n, i] - c * x[n, i]
                else:
                    dx[n, i] = r * w[i] * dy[n, i] - c * x[n, i]
    rows_per_chunk = (n_rows + ROW_CHUNKS - 1) // ROW_CHUNKS
    for chunk in prange(ROW_CHUNKS):
        acc = partial[chunk]
        acc[:] = 0.0
        for n in range(chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, n_rows)):
            r = rstd[n]
            for i in range(dim):
                acc[i] += dy[n, i] * (x[n, i] * r)
    for i in range(dim):
        total = 0.0
        for chunk in range(ROW_CHUNKS):
            total += partial[chunk, i]
        dw[i] = total


def rmsnorm_backward(x, w, rstd, dy, dx, dw, unit_offset):
    # in the forward pass this was: y[n, i] = g[i] * (x[n, i] * rstd[n]), g = w or 1 + w,
    # with rstd[n] = (sum_j x[n, j]² / D + eps)^(-1/2), so d rstd[n] / d x[n, j] = -rstd[n]³ x[n, j] / D.
    # so now we have (d g[i] / d w[i] = 1, so dw has the same form either way):
    #   dx[n, i] = rstd[n] * g[i] * dy[n, i] - rstd[n]³ / D * x[n, i] * sum_j dy[n, j] g[j] x[n, j]
    #   dw[i] = sum_n dy[n, i] * x[n, i] * rstd[n]
    # dx and dw are overwritten.
    rmsnorm_backward_kernel(x, w, rstd, dy, dx, dw, partials(x.shape[1]), False, unit_offset)


def rmsnorm_backward_add(x, w, rstd, dy, dx, dw, unit_offset):
    # as rmsnorm_backward, but the input gradient is added into dx: the norm's input also carries
    # on along the residual stream (a fan-out, Lean law residual_adjoint), whose gradient dx holds
    rmsnorm_backward_kernel(x, w, rstd, dy, dx, dw, partials(x.shape[1]), True, unit_offset)
