"""The spec-independent CPU kernels every generated kernel module re-exports: AdamW over the flat
parameter buffer, the element-wise joins of the residual stream and of gradients, and a linear
layer's forward product."""

import math

import numpy as np
from numba import njit, prange

from pyml.package.vector_math import dots_4x4

# AdamW adamw over flat 1-D buffers, with exactly torch.optim.AdamW's single-tensor arithmetic
# (torch/optim/adam.py, _single_tensor_adam, decoupled weight decay, no amsgrad, no maximize).
# grad_norm sums in this many fixed chunks, then the chunks in order: deterministic for any thread count
ADAMW_CHUNKS = 64


@njit(cache=True, parallel=True)
def adamw_step_kernel(
    params,
    grads,
    exp_avg,
    exp_avg_sq,
    decay,
    beta1_weight,
    one_minus_beta1_weight,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bias_correction2_sqrt,
    eps,
):
    # every scalar arrives in the parameters' dtype, so the arithmetic stays in that dtype (float32
    # math for float32 parameters, as torch's kernels do) and the loop vectorizes: one streaming pass
    # reading params, grads, exp_avg, exp_avg_sq and writing three of them (memory-bound).
    for i in prange(params.shape[0]):
        grad = grads[i]
        # param.mul_(1 - lr * weight_decay)
        param = params[i] * decay
        # exp_avg.lerp_(grad, 1 - beta1), in torch's CPU lerp form for a weight below / above 0.5
        if beta1_weight < 0.5:
            m = exp_avg[i] + beta1_weight * (grad - exp_avg[i])
        else:
            m = grad - (grad - exp_avg[i]) * one_minus_beta1_weight
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v = exp_avg_sq[i] * beta2 + one_minus_beta2 * grad * grad  # (value * grad) * grad, as torch
        exp_avg[i] = m
        exp_avg_sq[i] = v
        # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        denom = math.sqrt(v) / bias_correction2_sqrt + eps
        # param.addcdiv_(exp_avg, denom, value=-step_size): torch's kernel forms value * exp_avg first
        params[i] = param + neg_step_size * m / denom


def adamw_step(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step):
    # params, grads, exp_avg, exp_avg_sq are (P,) flat buffers of one dtype, updated in place;
    # step counts from 1 (torch increments its step before the update). The scalars are computed in
    # Python floats, as torch does, then rounded once to the parameters' dtype, as torch's kernels
    # convert a scalar argument; lerp's 1 - weight is formed in that dtype from the rounded weight.
    scalar = params.dtype.type
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    beta1_weight = scalar(1 - beta1)
    adamw_step_kernel(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        scalar(1 - lr * weight_decay),
        beta1_weight,
        scalar(1) - beta1_weight,
        scalar(beta2),
        scalar(1 - beta2),
        scalar(-step_size),
        scalar(bias_correction2_sqrt),
        scalar(eps),
    )


@njit(cache=True, parallel=True)
def adamw_grad_norm_kernel(grads):
    n = grads.shape[0]
    partial = np.zeros(ADAMW_CHUNKS)
    per_chunk = (n + ADAMW_CHUNKS - 1) // ADAMW_CHUNKS
    for chunk in prange(ADAMW_CHUNKS):
        acc = 0.0
        for i in range(chunk * per_chunk, min((chunk + 1) * per_chunk, n)):
            acc += np.float64(grads[i]) * np.float64(grads[i])
        partial[chunk] = acc
    total = 0.0
    for chunk in range(ADAMW_CHUNKS):
        total += partial[chunk]
    return math.sqrt(total)


def adamw_grad_norm(grads):
    # grads is (P,); the global L2 norm, accumulated in float64, as a Python float
    return float(adamw_grad_norm_kernel(grads))


@njit(cache=True, parallel=True)
def adamw_scale(grads, factor):
    # grads is (P,), multiplied in place by factor (gradient clipping)
    for i in prange(grads.shape[0]):
        grads[i] *= factor


@njit(cache=True, parallel=True)
def residual_add(x, r, out):
    # a residual join: out = x + r, element-wise on any shape; out may alias x (an in-place add).
    # Lean law residual_adjoint: its adjoint passes the output gradient to both x and r.
    x_flat = x.reshape(x.size)
    r_flat = r.reshape(r.size)
    out_flat = out.reshape(out.size)
    for i in prange(x_flat.size):
        out_flat[i] = x_flat[i] + r_flat[i]


def add_into(total, part):
    # a fan-out's adjoint (Lean law residual_adjoint): total += part, element-wise, for arrays of
    # one shape and any strides (numpy's add, no temporary)
    np.add(total, part, out=total)


def copy_into(out, source):
    # out = source, element-wise (a gradient that the adjoint wrote elsewhere)
    np.copyto(out, source)


# Below this many rows (a prompt, a small batch) a linear layer's product runs in few_rows_product,
# above it in OpenBLAS. OpenBLAS packs the weight into its own layout on every call, which costs
# about as much as the product when each weight meets few rows: measured on the 2-core development
# machine (2026-12-01, float32, 30 distinct weights of the SmolLM2 shapes, so read from memory as a
# prompt reads them), 46 rows ran at 68-86 GFLOP/s in OpenBLAS and 108-127 here; at 64 rows both
# about 125, at 96 OpenBLAS 153 against 127. One row is a matrix-vector product, BLAS's gemv.
FEW_ROWS = 64


def linear_product(x, w, y):
    # y = x @ w.T for x (N, in), w (out, in), y (N, out): a linear layer's forward, matVec W v per
    # row of x (Lean law linear_input_adjoint's forward); through OpenBLAS, np.matmul passing the
    # transpose as a flag (no copy, nothing allocated), or for few rows without packing the weight
    if 1 < x.shape[0] < FEW_ROWS:
        few_rows_product(x, w, y)
    else:
        np.matmul(x, w.T, out=y)


@njit(cache=True, parallel=True, fastmath={"contract", "reassoc"})
def few_rows_product(x, w, y):
    # y = x @ w.T for x (M, K) with few rows: each iteration of the parallel loop takes 4 rows of w
    # (they stay in L1) against the rows of x, 4 at a time (dots_4x4: 16 sums in registers over k),
    # so the weight is read from memory once. Each sum starts at its k = 0 product, which gives it
    # the arrays' dtype without a literal.
    M, K = x.shape
    N = w.shape[0]
    for block in prange(N // 4):
        n = 4 * block
        w0, w1, w2, w3 = w[n], w[n + 1], w[n + 2], w[n + 3]
        for m in range(0, M - M % 4, 4):
            (s00, s01, s02, s03, s10, s11, s12, s13,
             s20, s21, s22, s23, s30, s31, s32, s33) = dots_4x4(x[m], x[m + 1], x[m + 2], x[m + 3], w0, w1, w2, w3, K)
            y[m, n], y[m, n + 1], y[m, n + 2], y[m, n + 3] = s00, s01, s02, s03
            y[m + 1, n], y[m + 1, n + 1], y[m + 1, n + 2], y[m + 1, n + 3] = s10, s11, s12, s13
            y[m + 2, n], y[m + 2, n + 1], y[m + 2, n + 2], y[m + 2, n + 3] = s20, s21, s22, s23
            y[m + 3, n], y[m + 3, n + 1], y[m + 3, n + 2], y[m + 3, n + 3] = s30, s31, s32, s33
        for m in range(M - M % 4, M):
            xm = x[m]
            s0, s1, s2, s3 = w0[0] * xm[0], w1[0] * xm[0], w2[0] * xm[0], w3[0] * xm[0]
            for k in range(1, K):
                v = xm[k]
                s0 += w0[k] * v
                s1 += w1[k] * v
                s2 += w2[k] * v
                s3 += w3[k] * v
            y[m, n], y[m, n + 1], y[m, n + 2], y[m, n + 3] = s0, s1, s2, s3
    for n in range(N - N % 4, N):  # the last N % 4 rows of w, one at a time
        for m in range(M):
            s = w[n, 0] * x[m, 0]
            for k in range(1, K):
                s += w[n, k] * x[m, k]
            y[m, n] = s
