"""layernorm: y = (x - mean) · rstd · w (+ b) per row, rstd = 1 / sqrt(var + eps) with the biased
variance, as torch.nn.LayerNorm.

The gain is element-wise (Lean law hadamard_adjoint) and the bias is added to every row (Lean law
bias_adjoint: its gradient is the column sum); the normalisation is non-linear: numerics checked
against PyTorch and finite differences. The mean and variance are accumulated in float64 for every
input dtype; mean and rstd are stored (and used) in the input dtype. A layer without a bias runs
the same kernels with has_bias false (the gain stands in for the unused bias array).
"""

import math

import numpy as np
from numba import njit, prange

from pyml.package.cpu.rmsnorm import ROW_CHUNKS, partials


@njit(cache=True, parallel=True)
def forward_kernel(x, w, b, has_bias, y, mean, rstd, eps):
    # x is (N, dim), w and b are (dim,), y is (N, dim), mean and rstd are (N,) in x's dtype
    n_rows, dim = x.shape[0], x.shape[1]
    for n in prange(n_rows):
        total = 0.0
        for i in range(dim):
            total += np.float64(x[n, i])
        m = total / dim
        squares = 0.0
        for i in range(dim):
            centred = np.float64(x[n, i]) - m
            squares += centred * centred
        mean[n] = m
        rstd[n] = 1.0 / math.sqrt(squares / dim + eps)
        mu, r = mean[n], rstd[n]
        if has_bias:
            for i in range(dim):
                y[n, i] = (x[n, i] - mu) * r * w[i] + b[i]
        else:
            for i in range(dim):
                y[n, i] = (x[n, i] - mu) * r * w[i]


@njit(cache=True, parallel=True)
def backward_kernel(x, w, mean, rstd, dy, dx, dw, db, has_bias, partial, accumulate):
    # in the forward pass this was: y[n, i] = xhat[n, i] * w[i] + b[i], xhat = (x - mean) * rstd,
    # so now we have, with g[n, i] = dy[n, i] * w[i] and D the row's width:
    #   dx[n, i] = rstd[n] * (g[n, i] - sum_j g[n, j] / D - xhat[n, i] * sum_j g[n, j] xhat[n, j] / D)
    #   dw[i] = sum_n dy[n, i] * xhat[n, i],  db[i] = sum_n dy[n, i]
    n_rows, dim = x.shape[0], x.shape[1]
    for n in prange(n_rows):
        mu, r = mean[n], np.float64(rstd[n])
        g_sum, gx_sum = 0.0, 0.0
        for i in range(dim):
            g = np.float64(dy[n, i]) * np.float64(w[i])
            g_sum += g
            gx_sum += g * (np.float64(x[n, i] - mu) * r)
        g_mean, gx_mean = g_sum / dim, gx_sum / dim
        for i in range(dim):
            xhat = (x[n, i] - mu) * rstd[n]
            value = r * (dy[n, i] * w[i] - g_mean - xhat * gx_mean)
            if accumulate:
                dx[n, i] += value
            else:
                dx[n, i] = value
    # dw and db in fixed row chunks, each in row order, then the chunks in order: deterministic
    rows_per_chunk = (n_rows + ROW_CHUNKS - 1) // ROW_CHUNKS
    for chunk in prange(ROW_CHUNKS):
        acc = partial[chunk]
        acc[:] = 0.0
        for n in range(chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, n_rows)):
            mu, r = mean[n], rstd[n]
            for i in range(dim):
                acc[i] += dy[n, i] * ((x[n, i] - mu) * r)
                acc[dim + i] += dy[n, i]
    for i in range(dim):
        total, bias_total = 0.0, 0.0
        for chunk in range(ROW_CHUNKS):
            total += partial[chunk, i]
            bias_total += partial[chunk, dim + i]
        dw[i] = total
        if has_bias:
            db[i] = bias_total


@njit(cache=True)
def layernorm_forward(x, w, b, y, mean, rstd, eps):
    forward_kernel(x, w, b, True, y, mean, rstd, eps)


@njit(cache=True)
def layernorm_unbiased_forward(x, w, y, mean, rstd, eps):
    forward_kernel(x, w, w, False, y, mean, rstd, eps)


def layernorm_backward(x, w, mean, rstd, dy, dx, dw, db):
    # dx, dw and db are overwritten
    backward_kernel(x, w, mean, rstd, dy, dx, dw, db, True, partials(2 * x.shape[1]), False)


def layernorm_backward_add(x, w, mean, rstd, dy, dx, dw, db):
    # as layernorm_backward, but the input gradient is added into dx (a fan-out on the residual
    # stream, Lean law residual_adjoint)
    backward_kernel(x, w, mean, rstd, dy, dx, dw, db, True, partials(2 * x.shape[1]), True)


def layernorm_unbiased_backward(x, w, mean, rstd, dy, dx, dw):
    backward_kernel(x, w, mean, rstd, dy, dx, dw, dw, False, partials(2 * x.shape[1]), False)


def layernorm_unbiased_backward_add(x, w, mean, rstd, dy, dx, dw):
    backward_kernel(x, w, mean, rstd, dy, dx, dw, dw, False, partials(2 * x.shape[1]), True)
