"""The spec-independent CUDA kernels every generated CUDA kernel module re-exports: AdamW over the
flat parameter buffer, the element-wise joins of the residual stream and of gradients, and the
tiled matrix product every linear layer runs."""

import math

import numpy as np
from numba import cuda

from pyml.package.cuda_products import chosen_route, cublas_matmul

# AdamW adamw (CUDA) over flat 1-D buffers, one thread per element, with torch.optim.AdamW's
# single-tensor arithmetic (see the CPU template for the torch lines each step mirrors).
ADAMW_THREADS = 256
# grad_norm: this many blocks each reduce a fixed strided share; the host sums them in order
ADAMW_NORM_BLOCKS = 64
ADAMW_PARTIAL = []


@cuda.jit
def adamw_step_kernel(
    params,
    grads,
    exp_avg,
    exp_avg_sq,
    decay,
    beta1_weight,
    beta2,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
):
    i = cuda.grid(1)
    if i < params.size:
        grad = grads[i]
        param = params[i] * decay
        if beta1_weight < 0.5:
            m = exp_avg[i] + beta1_weight * (grad - exp_avg[i])
        else:
            m = grad - (grad - exp_avg[i]) * (1.0 - beta1_weight)
        v = exp_avg_sq[i] * beta2 + one_minus_beta2 * grad * grad
        exp_avg[i] = m
        exp_avg_sq[i] = v
        denom = math.sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps
        params[i] = param + (-step_size) * (exp_avg[i] / denom)


def adamw_step(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step):
    # params, grads, exp_avg, exp_avg_sq are (P,) device buffers, updated in place; step counts from 1
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    blocks = (params.size + ADAMW_THREADS - 1) // ADAMW_THREADS
    adamw_step_kernel[blocks, ADAMW_THREADS](
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
    )


@cuda.jit
def adamw_sum_squares_kernel(grads, partial_out):
    partial = cuda.shared.array(ADAMW_THREADS, np.float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(cuda.grid(1), grads.size, ADAMW_THREADS * ADAMW_NORM_BLOCKS):
        acc += np.float64(grads[i]) * np.float64(grads[i])
    partial[tid] = acc
    cuda.syncthreads()
    stride = ADAMW_THREADS // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        partial_out[cuda.blockIdx.x] = partial[0]


def adamw_grad_norm(grads):
    # grads is (P,); the global L2 norm accumulated in float64, as a Python float
    if not ADAMW_PARTIAL:
        ADAMW_PARTIAL.append(cuda.device_array(ADAMW_NORM_BLOCKS, dtype=np.float64))
    partial = ADAMW_PARTIAL[0]
    adamw_sum_squares_kernel[ADAMW_NORM_BLOCKS, ADAMW_THREADS](grads, partial)
    total = 0.0
    for value in partial.copy_to_host():
        total += float(value)
    return math.sqrt(total)


@cuda.jit
def adamw_scale_kernel(grads, factor):
    i = cuda.grid(1)
    if i < grads.size:
        grads[i] *= factor


def adamw_scale(grads, factor):
    # grads is (P,), multiplied in place by factor (gradient clipping)
    adamw_scale_kernel[(grads.size + ADAMW_THREADS - 1) // ADAMW_THREADS, ADAMW_THREADS](
        grads, factor
    )


JOIN_THREADS = 256


@cuda.jit(device=True)
def sigmoid(z, one):
    # 1 / (1 + exp(-z)) with exp of -|z| only: on a GPU exp(-z) of a large negative z is inf and the
    # quotient still 0, but the CUDA simulator's math.exp raises OverflowError there (found by the
    # simulator fuzz: a GeGLU gate of -300). `one` is 1 in the caller's dtype, so float32 stays so.
    e = math.exp(-abs(z))
    if z >= 0:
        return one / (one + e)
    return e / (one + e)


@cuda.jit
def residual_add_kernel(x, r, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] + r[i]


@cuda.jit
def add_into_kernel(total, part):
    i = cuda.grid(1)
    if i < total.size:
        total[i] += part[i]


@cuda.jit
def copy_into_kernel(out, source):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = source[i]


def residual_add(x, r, out):
    # a residual join: out = x + r on contiguous arrays of any shape; out may alias x.
    # Lean law residual_adjoint: its adjoint passes the output gradient to both x and r.
    n = x.size
    residual_add_kernel[(n + JOIN_THREADS - 1) // JOIN_THREADS, JOIN_THREADS](
        x.reshape(n), r.reshape(n), out.reshape(n)
    )


def add_into(total, part):
    # a fan-out's adjoint (Lean law residual_adjoint): total += part, contiguous, same shape
    n = total.size
    add_into_kernel[(n + JOIN_THREADS - 1) // JOIN_THREADS, JOIN_THREADS](
        total.reshape(n), part.reshape(n)
    )


def copy_into(out, source):
    # out = source (a gradient that the adjoint wrote elsewhere), contiguous, same shape
    n = out.size
    copy_into_kernel[(n + JOIN_THREADS - 1) // JOIN_THREADS, JOIN_THREADS](
        out.reshape(n), source.reshape(n)
    )


# Tiled shared-memory matrix product (MATMUL_TILE x MATMUL_TILE tiles), shared by every linear
# layer, in three layouts so that no transposed copy is made: NT (x @ w.T), NN (dy @ w),
# TN (dy.T @ x). One kernel per layout and dtype, so that tiles and accumulators stay in the input
# dtype; whether an operand is transposed is a constant of its kernel. On a GPU,
# PYML_CUDA_PRODUCTS=cublas runs the same products through cuBLAS instead.
MATMUL_TILE = 16


def matmul_kernel(layout, dtype):
    """c = A B for c (M, N), A = a or a.T and B = b or b.T as `layout` ("nt", "nn", "tn") says."""
    a_transposed, b_transposed = layout[0] == "t", layout[1] == "t"

    @cuda.jit
    def kernel(a, b, c):
        a_tile = cuda.shared.array((MATMUL_TILE, MATMUL_TILE), dtype)
        b_tile = cuda.shared.array((MATMUL_TILE, MATMUL_TILE), dtype)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row = cuda.blockIdx.y * MATMUL_TILE + ty
        col = cuda.blockIdx.x * MATMUL_TILE + tx
        n_rows, n_cols = c.shape
        depth = a.shape[0] if a_transposed else a.shape[1]
        acc = dtype(0.0)
        for k0 in range(0, depth, MATMUL_TILE):
            if row < n_rows and k0 + tx < depth:
                a_tile[ty, tx] = a[k0 + tx, row] if a_transposed else a[row, k0 + tx]
            else:
                a_tile[ty, tx] = 0.0
            if col < n_cols and k0 + ty < depth:
                b_tile[ty, tx] = b[col, k0 + ty] if b_transposed else b[k0 + ty, col]
            else:
                b_tile[ty, tx] = 0.0
            cuda.syncthreads()
            for kk in range(MATMUL_TILE):
                acc += a_tile[ty, kk] * b_tile[kk, tx]
            cuda.syncthreads()
        if row < n_rows and col < n_cols:
            c[row, col] = acc

    return kernel


MATMUL_KERNELS = {np.dtype(dtype): {layout: matmul_kernel(layout, dtype) for layout in ("nt", "nn", "tn")}
                  for dtype in (np.float32, np.float64)}


def matmul(layout, a, b, c):
    # c is (M, N), a and b as `layout` says; c's dtype picks the kernel, or PYML_CUDA_PRODUCTS
    # routes the product to cuBLAS (pyml/package/cuda_products.py)
    if chosen_route() == "cublas":
        cublas_matmul(layout, a, b, c)
        return
    threads = (MATMUL_TILE, MATMUL_TILE)
    blocks = (
        (c.shape[1] + MATMUL_TILE - 1) // MATMUL_TILE,
        (c.shape[0] + MATMUL_TILE - 1) // MATMUL_TILE,
    )
    MATMUL_KERNELS[np.dtype(c.dtype)][layout][blocks, threads](a, b, c)
