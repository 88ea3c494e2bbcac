"""The spec-independent CPU kernels every generated kernel module re-exports: AdamW over the flat
parameter buffer, and the element-wise joins of the residual stream and of gradients."""

import math

import numpy as np
from numba import njit, prange

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
