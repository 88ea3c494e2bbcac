"""The element-wise activations relu, gelu (exact erf form, torch's default) and silu, on any
shape. Each backward multiplies dy element-wise by the derivative at x, the adjoint of
v -> f'(x) * v (Lean law hadamard_adjoint); f' itself is checked against PyTorch (and, for the
smooth ones, finite differences)."""

import math

from numba import njit, prange

from pyml.package.vector_math import sigmoid_vectorizable

INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@njit(cache=True, parallel=True)
def relu_forward(x, y):
    # y = max(x, 0); x, y have the same shape
    x_flat = x.reshape(x.size)
    y_flat = y.reshape(y.size)
    for i in prange(x_flat.size):
        y_flat[i] = x_flat[i] if x_flat[i] > 0 else 0


@njit(cache=True, parallel=True)
def relu_backward(x, dy, dx):
    # dx = dy where x > 0, else 0 (torch's convention at x = 0). dx is overwritten.
    x_flat = x.reshape(x.size)
    dy_flat = dy.reshape(dy.size)
    dx_flat = dx.reshape(dx.size)
    for i in prange(x_flat.size):
        dx_flat[i] = dy_flat[i] if x_flat[i] > 0 else 0


@njit(cache=True, parallel=True)
def gelu_forward(x, y):
    # y = x * Φ(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
    x_flat = x.reshape(x.size)
    y_flat = y.reshape(y.size)
    for i in prange(x_flat.size):
        y_flat[i] = 0.5 * x_flat[i] * (1.0 + math.erf(x_flat[i] * INV_SQRT2))


@njit(cache=True, parallel=True)
def gelu_backward(x, dy, dx):
    # dx = dy * (Φ(x) + x * φ(x)), φ(x) = exp(-x² / 2) / sqrt(2π). dx is overwritten.
    x_flat = x.reshape(x.size)
    dy_flat = dy.reshape(dy.size)
    dx_flat = dx.reshape(dx.size)
    for i in prange(x_flat.size):
        v = x_flat[i]
        cdf = 0.5 * (1.0 + math.erf(v * INV_SQRT2))
        pdf = math.exp(-0.5 * v * v) * INV_SQRT_2PI
        dx_flat[i] = dy_flat[i] * (cdf + v * pdf)


@njit(cache=True, parallel=True)
def silu_forward(x, y):
    # y = x * sigmoid(x)
    x_flat = x.reshape(x.size)
    y_flat = y.reshape(y.size)
    for i in prange(x_flat.size):
        y_flat[i] = x_flat[i] * sigmoid_vectorizable(x_flat[i])


@njit(cache=True, parallel=True)
def silu_backward(x, dy, dx):
    # dx = dy * sig (1 + x (1 - sig)) = dy * (sig + silu sigmoid(-x)), sig = sigmoid(x): 1 - sig is
    # sigmoid(-x), which neither cancels (as sig + silu - silu sig did once silu rounded sig away)
    # nor needs a float64 literal. dx is overwritten.
    x_flat = x.reshape(x.size)
    dy_flat = dy.reshape(dy.size)
    dx_flat = dx.reshape(dx.size)
    for i in prange(x_flat.size):
        sig = sigmoid_vectorizable(x_flat[i])
        silu = x_flat[i] * sig
        dx_flat[i] = dy_flat[i] * (sig + silu * sigmoid_vectorizable(-x_flat[i]))
