"""head_rmsnorm (CUDA, QK-norm): the RMSNorm of every head's head_dim features, one gain shared by
the heads; as pyml.package.cpu.head_rmsnorm. x, y, dy, dx are (N, heads, head_dim) device arrays
whose last axis is contiguous: views into the fused q/k/v buffer. One block per (n, h) row, its
sums by a float64 shared-memory tree; dw one thread per feature, rows and heads in order."""

import math

import numpy as np
from numba import cuda

from pyml.package.cuda.reduce import block_sum
from pyml.package.cuda.rmsnorm import gain

THREADS = 64


@cuda.jit
def forward_kernel(x, w, y, rstd, eps, unit_offset):
    # each thread reads x only at its own features, the ones it writes: y may alias x
    partial = cuda.shared.array(THREADS, np.float64)
    n_heads, head_dim = x.shape[1], x.shape[2]
    n, h = cuda.blockIdx.x // n_heads, cuda.blockIdx.x % n_heads
    sum_sq = 0.0
    for i in range(cuda.threadIdx.x, head_dim, THREADS):
        sum_sq += np.float64(x[n, h, i]) * np.float64(x[n, h, i])
    sum_sq = block_sum(partial, sum_sq)
    if cuda.threadIdx.x == 0:
        rstd[n, h] = 1.0 / math.sqrt(sum_sq / head_dim + eps)
    cuda.syncthreads()
    r = rstd[n, h]
    for i in range(cuda.threadIdx.x, head_dim, THREADS):
        y[n, h, i] = gain(w, i, unit_offset) * (x[n, h, i] * r)


@cuda.jit
def backward_dx_kernel(x, w, rstd, dy, dx, unit_offset):
    # each thread reads dy at its own features, and writes dx there only after the block's sum:
    # dx may alias dy
    partial = cuda.shared.array(THREADS, np.float64)
    n_heads, head_dim = x.shape[1], x.shape[2]
    n, h = cuda.blockIdx.x // n_heads, cuda.blockIdx.x % n_heads
    dot = 0.0
    for i in range(cuda.threadIdx.x, head_dim, THREADS):
        dot += np.float64(dy[n, h, i]) * np.float64(gain(w, i, unit_offset)) * np.float64(x[n, h, i])
    dot = block_sum(partial, dot)
    r = np.float64(rstd[n, h])
    c = r * r * r * dot / head_dim
    for i in range(cuda.threadIdx.x, head_dim, THREADS):
        dx[n, h, i] = r * gain(w, i, unit_offset) * dy[n, h, i] - c * x[n, h, i]


@cuda.jit
def backward_dw_kernel(x, rstd, dy, dw):
    # one thread per feature, rows and heads summed in order into a float64 (deterministic)
    i = cuda.grid(1)
    if i < x.shape[2]:
        total = 0.0
        for n in range(x.shape[0]):
            for h in range(x.shape[1]):
                total += dy[n, h, i] * (x[n, h, i] * rstd[n, h])
        dw[i] = total


def head_rmsnorm_forward(x, w, y, rstd, eps, unit_offset):
    # x, y are (N, heads, head_dim) (strided; y may alias x), w is (head_dim,), rstd is (N, heads)
    forward_kernel[x.shape[0] * x.shape[1], THREADS](x, w, y, rstd, eps, unit_offset)


def head_rmsnorm_backward(x, w, rstd, dy, dx, dw, unit_offset):
    # as the CPU kernel's: per head the RMSNorm row backward, dw summed over the heads
    # (Lean law hadamard_adjoint). dx (it may alias dy: dw is taken first) and dw are overwritten.
    backward_dw_kernel[(x.shape[2] + 63) // 64, 64](x, rstd, dy, dw)
    backward_dx_kernel[x.shape[0] * x.shape[1], THREADS](x, w, rstd, dy, dx, unit_offset)
