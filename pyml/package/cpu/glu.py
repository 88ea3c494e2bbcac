"""The gated MLPs' element-wise part: h = f(gate) * up, from gate_up, the output of the one linear
layer of the gate and up projections (gate in columns :hidden, up in hidden:). SwiGLU's f is silu
(g * sigmoid(g)), GeGLU's torch's tanh-approximated GELU (Gemma's gelu_pytorch_tanh; vector_math's
gelu_tanh_vectorizable says how it is computed). The gate acts on up as an element-wise gain (Lean
law hadamard_adjoint); f' is checked against PyTorch and finite differences."""

from numba import njit, prange

from pyml.package.vector_math import (
    gelu_tanh_vectorizable,
    gelu_tanh_with_derivative_vectorizable,
    sigmoid_vectorizable,
)


@njit(cache=True, parallel=True)
def swiglu_forward(gate_up, h):
    # gate_up is (N, 2 * hidden), h is (N, hidden)
    hidden = h.shape[1]
    for n in prange(h.shape[0]):
        for i in range(hidden):
            g = gate_up[n, i]
            h[n, i] = g * sigmoid_vectorizable(g) * gate_up[n, hidden + i]


@njit(cache=True, parallel=True)
def swiglu_backward(gate_up, dh, dgate_up):
    # in the forward pass this was: h = silu(gate) * up
    # so now we have: dup = dh * silu(gate),  dgate = dh * up * silu'(gate)
    # with silu'(g) = sig (1 + g (1 - sig)) = sig + silu sigmoid(-g), sig = sigmoid(g): 1 - sig is
    # sigmoid(-g), which neither cancels nor needs a literal (a float64 one would widen float32
    # arithmetic); written sig + silu - silu sig, a large silu rounded sig away (float64 gates past
    # 2^53 had slope 0 for 1). dgate_up (like gate_up) is overwritten; dh is (N, hidden).
    hidden = dh.shape[1]
    for n in prange(dh.shape[0]):
        for i in range(hidden):
            g = gate_up[n, i]
            sig = sigmoid_vectorizable(g)
            silu = g * sig
            dgate_up[n, hidden + i] = dh[n, i] * silu
            dgate_up[n, i] = dh[n, i] * gate_up[n, hidden + i] * (sig + silu * sigmoid_vectorizable(-g))


@njit(cache=True, parallel=True)
def geglu_forward(gate_up, h):
    # gate_up is (N, 2 * hidden), h is (N, hidden)
    hidden = h.shape[1]
    for n in prange(h.shape[0]):
        for i in range(hidden):
            h[n, i] = gelu_tanh_vectorizable(gate_up[n, i]) * gate_up[n, hidden + i]


@njit(cache=True, parallel=True)
def geglu_backward(gate_up, dh, dgate_up):
    # in the forward pass this was: h = gelu_tanh(gate) * up
    # so now we have: dup = dh * gelu_tanh(gate),  dgate = dh * up * gelu_tanh'(gate)
    # dgate_up (like gate_up) is overwritten; dh is (N, hidden).
    hidden = dh.shape[1]
    for n in prange(dh.shape[0]):
        for i in range(hidden):
            gelu, slope = gelu_tanh_with_derivative_vectorizable(gate_up[n, i])
            dgate_up[n, hidden + i] = dh[n, i] * gelu
            dgate_up[n, i] = dh[n, i] * gate_up[n, hidden + i] * slope
