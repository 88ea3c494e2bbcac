"""layernorm (CUDA): y = (x - mean) · rstd · w (+ b) per row, as pyml.package.cpu.layernorm. One
block per row, its sums by float64 shared-memory trees (deterministic); dw and db one thread per
column, rows in order."""

import math

import numpy as np
from numba import cuda

from pyml.package.cuda.reduce import block_sum

THREADS = 128


@cuda.jit
def forward_kernel(x, w, b, has_bias, y, mean, rstd, eps):
    partial = cuda.shared.array(THREADS, np.float64)
    n, dim = cuda.blockIdx.x, x.shape[1]
    total = 0.0
    for i in range(cuda.threadIdx.x, dim, THREADS):
        total += np.float64(x[n, i])
    m = block_sum(partial, total) / dim
    squares = 0.0
    for i in range(cuda.threadIdx.x, dim, THREADS):
        centred = np.float64(x[n, i]) - m
        squares += centred * centred
    squares = block_sum(partial, squares)
    if cuda.threadIdx.x == 0:
        mean[n] = m
        rstd[n] = 1.0 / math.sqrt(squares / dim + eps)
    cuda.syncthreads()
    mu, r = mean[n], rstd[n]
    for i in range(cuda.threadIdx.x, dim, THREADS):
        value = (x[n, i] - mu) * r * w[i]
        y[n, i] = value + b[i] if has_bias else value


@cuda.jit
def backward_dx_kernel(x, w, mean, rstd, dy, dx, accumulate):
    partial = cuda.shared.array(THREADS, np.float64)
    n, dim = cuda.blockIdx.x, x.shape[1]
    mu, r = mean[n], np.float64(rstd[n])
    g_sum, gx_sum = 0.0, 0.0
    for i in range(cuda.threadIdx.x, dim, THREADS):
        g = np.float64(dy[n, i]) * np.float64(w[i])
        g_sum += g
        gx_sum += g * (np.float64(x[n, i] - mu) * r)
    g_mean = block_sum(partial, g_sum) / dim
    gx_mean = block_sum(partial, gx_sum) / dim
    for i in range(cuda.threadIdx.x, dim, THREADS):
        xhat = (x[n, i] - mu) * rstd[n]
        value = r * (dy[n, i] * w[i] - g_mean - xhat * gx_mean)
        if accumulate:
            dx[n, i] += value
        else:
            dx[n, i] = value


@cuda.jit
def backward_params_kernel(x, mean, rstd, dy, dw, db, has_bias):
    # one thread per column, rows summed in order (deterministic)
    i = cuda.grid(1)
    if i < x.shape[1]:
        total, bias_total = 0.0, 0.0
        for n in range(x.shape[0]):
            total += dy[n, i] * ((x[n, i] - mean[n]) * rstd[n])
            bias_total += dy[n, i]
        dw[i] = total
        if has_bias:
            db[i] = bias_total


def layernorm_forward(x, w, b, y, mean, rstd, eps):
    forward_kernel[x.shape[0], THREADS](x, w, b, True, y, mean, rstd, eps)


def layernorm_unbiased_forward(x, w, y, mean, rstd, eps):
    forward_kernel[x.shape[0], THREADS](x, w, w, False, y, mean, rstd, eps)


def backward(x, w, mean, rstd, dy, dx, dw, db, has_bias, accumulate):
    backward_dx_kernel[x.shape[0], THREADS](x, w, mean, rstd, dy, dx, accumulate)
    backward_params_kernel[(x.shape[1] + 127) // 128, 128](x, mean, rstd, dy, dw, db, has_bias)


def layernorm_backward(x, w, mean, rstd, dy, dx, dw, db):
    backward(x, w, mean, rstd, dy, dx, dw, db, True, False)


def layernorm_backward_add(x, w, mean, rstd, dy, dx, dw, db):
    backward(x, w, mean, rstd, dy, dx, dw, db, True, True)


def layernorm_unbiased_backward(x, w, mean, rstd, dy, dx, dw):
    backward(x, w, mean, rstd, dy, dx, dw, dw, False, False)


def layernorm_unbiased_backward_add(x, w, mean, rstd, dy, dx, dw):
    backward(x, w, mean, rstd, dy, dx, dw, dw, False, True)
