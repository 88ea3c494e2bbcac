"""relu, gelu (exact erf form) and silu (CUDA), element-wise on any shape, as
pyml.package.cpu.activations."""

import math

from numba import cuda

from pyml.package.kernels_cuda import sigmoid

INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@cuda.jit
def relu_forward_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] if x[i] > 0 else 0


@cuda.jit
def relu_backward_kernel(x, dy, dx):
    i = cuda.grid(1)
    if i < x.size:
        dx[i] = dy[i] if x[i] > 0 else 0


@cuda.jit
def gelu_forward_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = 0.5 * x[i] * (1.0 + math.erf(x[i] * INV_SQRT2))


@cuda.jit
def gelu_backward_kernel(x, dy, dx):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        cdf = 0.5 * (1.0 + math.erf(v * INV_SQRT2))
        pdf = math.exp(-0.5 * v * v) * INV_SQRT_2PI
        dx[i] = dy[i] * (cdf + v * pdf)


@cuda.jit
def silu_forward_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] * sigmoid(x[i], 1.0)


@cuda.jit
def silu_backward_kernel(x, dy, dx):
    i = cuda.grid(1)
    if i < x.size:
        sig = sigmoid(x[i], 1.0)
        dx[i] = dy[i] * (sig * (1.0 + x[i] * (1.0 - sig)))


def flat_launch(kernel, *arrays):
    n = arrays[0].size
    kernel[(n + 255) // 256, 256](*(array.reshape(n) for array in arrays))


def relu_forward(x, y):
    flat_launch(relu_forward_kernel, x, y)


def relu_backward(x, dy, dx):
    # dx = dy where x > 0, else 0 (torch's convention at 0); dx is overwritten
    flat_launch(relu_backward_kernel, x, dy, dx)


def gelu_forward(x, y):
    flat_launch(gelu_forward_kernel, x, y)


def gelu_backward(x, dy, dx):
    # dx = dy * (Φ(x) + x φ(x)); dx is overwritten
    flat_launch(gelu_backward_kernel, x, dy, dx)


def silu_forward(x, y):
    flat_launch(silu_forward_kernel, x, y)


def silu_backward(x, dy, dx):
    # dx = dy * sigmoid(x) * (1 + x * (1 - sigmoid(x))); dx is overwritten
    flat_launch(silu_backward_kernel, x, dy, dx)
