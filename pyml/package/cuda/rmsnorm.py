"""rmsnorm (CUDA): y = x · rstd · g, rstd = 1 / sqrt(mean(x²) + eps), g = w or 1 + w (unit_offset,
in the input dtype); as pyml.package.cpu.rmsnorm. One block per row; the row's sums by a float64
shared-memory tree (deterministic); dw one thread per column, rows in order."""

import math

import numpy as np
from numba import cuda

from pyml.package.cuda.reduce import block_sum

THREADS = 128
ONE = np.float32(1.0)  # a float32 1: keeps float32 arithmetic float32, and is exact in float64


@cuda.jit(device=True)
def gain(w, i, unit_offset):
    return w[i] + ONE if unit_offset else w[i]


@cuda.jit(device=True)
def normalize_row(partial, x, w, y, rstd, n, eps, unit_offset):
    # row n of y = rmsnorm(x), rstd[n] with it; each thread reads x only at its own columns
    dim = x.shape[1]
    sum_sq = 0.0
    for i in range(cuda.threadIdx.x, dim, THREADS):
        sum_sq += np.float64(x[n, i]) * np.float64(x[n, i])
    sum_sq = block_sum(partial, sum_sq)
    if cuda.threadIdx.x == 0:
        rstd[n] = 1.0 / math.sqrt(sum_sq / dim + eps)
    cuda.syncthreads()
    r = rstd[n]
    for i in range(cuda.threadIdx.x, dim, THREADS):
        y[n, i] = gain(w, i, unit_offset) * (x[n, i] * r)


@cuda.jit
def forward_kernel(x, w, y, rstd, eps, unit_offset):
    partial = cuda.shared.array(THREADS, np.float64)
    normalize_row(partial, x, w, y, rstd, cuda.blockIdx.x, eps, unit_offset)


@cuda.jit
def forward_residual_kernel(x, r, x_out, w, y, rstd, eps, unit_offset):
    # each thread reads x and r and writes x_out at its own columns, the columns it then
    # normalizes, so x_out may alias x and needs no barrier
    partial = cuda.shared.array(THREADS, np.float64)
    n = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, x.shape[1], THREADS):
        x_out[n, i] = x[n, i] + r[n, i]
    normalize_row(partial, x_out, w, y, rstd, n, eps, unit_offset)


@cuda.jit
def backward_dx_kernel(x, w, rstd, dy, dx, accumulate, unit_offset):
    partial = cuda.shared.array(THREADS, np.float64)
    n, dim = cuda.blockIdx.x, x.shape[1]
    dot = 0.0
    for i in range(cuda.threadIdx.x, dim, THREADS):
        dot += np.float64(dy[n, i]) * np.float64(gain(w, i, unit_offset)) * np.float64(x[n, i])
    dot = block_sum(partial, dot)
    r = np.float64(rstd[n])
    c = r * r * r * dot / dim
    for i in range(cuda.threadIdx.x, dim, THREADS):
        if accumulate:
            dx[n, i] += r * gain(w, i, unit_offset) * dy[n, i] - c * x[n, i]
        else:
            dx[n, i] = r * gain(w, i, unit_offset) * dy[n, i] - c * x[n, i]


@cuda.jit
def backward_dw_kernel(x, rstd, dy, dw):
    # one thread per column, rows summed in order (deterministic)
    i = cuda.grid(1)
    if i < x.shape[1]:
        dw[i] = 0.0
        for n in range(x.shape[0]):
            dw[i] += dy[n, i] * (x[n, i] * rstd[n])


def rmsnorm_forward(x, w, y, rstd, eps, unit_offset):
    # x is (N, dim), w is (dim,), y is (N, dim), rstd is (N,) in x's dtype
    forward_kernel[x.shape[0], THREADS](x, w, y, rstd, eps, unit_offset)


def rmsnorm_forward_residual(x, r, x_out, w, y, rstd, eps, unit_offset):
    # fused: x_out = x + r, then y = rmsnorm(x_out); x_out may alias x
    forward_residual_kernel[x.shape[0], THREADS](x, r, x_out, w, y, rstd, eps, unit_offset)


def rmsnorm_backward(x, w, rstd, dy, dx, dw, unit_offset):
    # in the forward pass this was: y[n, i] = g[i] * (x[n, i] * rstd[n]), so now we have
    #   dx[n, i] = rstd[n] * g[i] * dy[n, i] - rstd[n]³ / D * x[n, i] * sum_j dy[n, j] g[j] x[n, j]
    #   dw[i] = sum_n dy[n, i] * x[n, i] * rstd[n]
    # dx and dw are overwritten.
    backward_dx_kernel[x.shape[0], THREADS](x, w, rstd, dy, dx, False, unit_offset)
    backward_dw_kernel[(x.shape[1] + 127) // 128, 128](x, rstd, dy, dw)


def rmsnorm_backward_add(x, w, rstd, dy, dx, dw, unit_offset):
    # as rmsnorm_backward, but the input gradient is added into dx: the norm's input also carries
    # on along the residual stream (a fan-out, Lean law residual_adjoint), whose gradient dx holds
    backward_dx_kernel[x.shape[0], THREADS](x, w, rstd, dy, dx, True, unit_offset)
    backward_dw_kernel[(x.shape[1] + 127) // 128, 128](x, rstd, dy, dw)
