"""The gated MLPs' element-wise part (CUDA): h = f(gate) * up from gate_up = [gate | up], SwiGLU's
f = silu, GeGLU's torch's tanh-approximated GELU, computed as x * s, s = sigmoid(2u) =
0.5 (1 + tanh(u)), u = sqrt(2/π) (x + 0.044715 x³): the same function, one exp, and no
cancellation where 1 + tanh(u) is small. GeGLU's constants are passed in the arrays' dtype, so that
float32 arithmetic stays float32 (a float64 literal would widen it)."""

import math

from numba import cuda

from pyml.package.kernels_cuda import sigmoid

TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


@cuda.jit
def swiglu_forward_kernel(gate_up, h):
    index = cuda.grid(1)
    if index < h.size:
        hidden = h.shape[1]
        n, i = index // hidden, index % hidden
        g = gate_up[n, i]
        h[n, i] = g * sigmoid(g, 1.0) * gate_up[n, hidden + i]


@cuda.jit
def swiglu_backward_kernel(gate_up, dh, dgate_up):
    index = cuda.grid(1)
    if index < dh.size:
        hidden = dh.shape[1]
        n, i = index // hidden, index % hidden
        g = gate_up[n, i]
        sig = sigmoid(g, 1.0)
        dgate_up[n, hidden + i] = dh[n, i] * (g * sig)
        dgate_up[n, i] = dh[n, i] * gate_up[n, hidden + i] * (sig * (1.0 + g * (1.0 - sig)))


def geglu_constants(dtype):
    # (1, 2 sqrt(2/π), 0.044715, 3 * 0.044715) in dtype
    return (dtype.type(1.0), dtype.type(TWO_SQRT_2_OVER_PI), dtype.type(CUBIC),
            dtype.type(3.0 * CUBIC))


@cuda.jit
def geglu_forward_kernel(gate_up, h, one, two_sqrt_2_over_pi, cubic):
    index = cuda.grid(1)
    if index < h.size:
        hidden = h.shape[1]
        n, i = index // hidden, index % hidden
        g = gate_up[n, i]
        s = sigmoid(two_sqrt_2_over_pi * (g + cubic * g * g * g), one)
        h[n, i] = g * s * gate_up[n, hidden + i]


@cuda.jit
def geglu_backward_kernel(gate_up, dh, dgate_up, one, two_sqrt_2_over_pi, cubic, three_cubic):
    index = cuda.grid(1)
    if index < dh.size:
        hidden = dh.shape[1]
        n, i = index // hidden, index % hidden
        g = gate_up[n, i]
        s = sigmoid(two_sqrt_2_over_pi * (g + cubic * g * g * g), one)
        slope = two_sqrt_2_over_pi * (one + three_cubic * g * g)
        dgate_up[n, hidden + i] = dh[n, i] * (g * s)
        dgate_up[n, i] = dh[n, i] * gate_up[n, hidden + i] * (s + g * s * (one - s) * slope)


def swiglu_forward(gate_up, h):
    swiglu_forward_kernel[(h.size + 255) // 256, 256](gate_up, h)


def swiglu_backward(gate_up, dh, dgate_up):
    # dup = dh * silu(gate), dgate = dh * up * silu'(gate); dgate_up is overwritten
    swiglu_backward_kernel[(dh.size + 255) // 256, 256](gate_up, dh, dgate_up)


def geglu_forward(gate_up, h):
    one, two_sqrt_2_over_pi, cubic, _ = geglu_constants(h.dtype)
    geglu_forward_kernel[(h.size + 255) // 256, 256](gate_up, h, one, two_sqrt_2_over_pi, cubic)


def geglu_backward(gate_up, dh, dgate_up):
    # gelu_tanh'(g) = s + g s (1 - s) dz/dg, z = 2u, dz/dg = 2 sqrt(2/π) (1 + 3 * 0.044715 g²);
    # dgate_up is overwritten
    geglu_backward_kernel[(dh.size + 255) // 256, 256](gate_up, dh, dgate_up, *geglu_constants(dh.dtype))
