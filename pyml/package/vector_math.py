"""Scalar math that LLVM can vectorize, for the generated CPU kernels (which import it).

LLVM vectorizes a loop only when everything in it is inlined arithmetic: libm's exp is an opaque
call (this numba has no SVML), a float64 running sum is a chain of dependent adds unless
reassociation is allowed, and a running max is a chain of compare-selects. Measured on the SmolLM2
step (2 cores, AVX-512): the SwiGLU forward over (256, 1536) went from 1.06 ms with libm's exp to
0.16 ms.

exp for float32 is Cephes' expf: x = n ln2 + r with ln2 in two parts (exact n * C1), a degree-7
polynomial for exp(r), and 2^n built from the exponent bits. It is within 1 ulp of the float64 exp
on [-87, 88] (tests/kernels/test_vector_math.py); the argument is clamped to that range first, so results
below exp(-87) = 1.6e-38 read as 1.6e-38 (no sum here notices) and above exp(88) as exp(88). NaN
passes through. Float64 arguments use libm's exp, so the float64 kernels keep full precision.

Numba's cache does not notice when a function a cached kernel calls changes in another file, so the
generated kernel modules carry this module's hash in their first line: a change here changes them,
and their caches are rebuilt.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

EXP_F32_LOW = np.float32(-87.0)
EXP_F32_HIGH = np.float32(88.0)
EXP_F32_LOG2E = np.float32(1.44269504088896341)
EXP_F32_LN2_HIGH = np.float32(0.693359375)
EXP_F32_LN2_LOW = np.float32(-2.12194440e-4)
EXP_F32_POLYNOMIAL = (
    np.float32(1.9875691500e-4),
    np.float32(1.3981999507e-3),
    np.float32(8.3334519073e-3),
    np.float32(4.1665795894e-2),
    np.float32(1.6666665459e-1),
    np.float32(5.0000001201e-1),
)
F32_HALF = np.float32(0.5)
F32_ONE = np.float32(1.0)
# GELU, tanh approximation (torch's gelu(x, approximate="tanh")):
#   gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/π) (x + 0.044715 x³),
# computed as x * sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)), which needs only
# the vectorizable exp and keeps its relative precision where 1 + tanh(u) would cancel (x << 0).
# The constants exist in each dtype, so that float32 arithmetic stays float32.
GELU_TANH_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
GELU_TANH_THREE_CUBIC = 3.0 * GELU_TANH_CUBIC
F32_GELU_TANH_TWO_SQRT_2_OVER_PI = np.float32(GELU_TANH_TWO_SQRT_2_OVER_PI)
F32_GELU_TANH_CUBIC = np.float32(GELU_TANH_CUBIC)
F32_GELU_TANH_THREE_CUBIC = np.float32(GELU_TANH_THREE_CUBIC)
# lanes of the running maximum: one AVX-512 register of float32
MAX_LANES = 16


def exp_vectorizable(x):
    """exp(x), vectorizable in float32; the overload below is what the kernels compile."""
    return math.exp(x)


def sigmoid_vectorizable(x):
    """1 / (1 + exp(-x)) in x's dtype; the overload below is what the kernels compile."""
    return 1.0 / (1.0 + math.exp(-x))


def gelu_tanh_vectorizable(x):
    """gelu_tanh(x) in x's dtype; the overload below is what the kernels compile."""
    return gelu_tanh_with_derivative_vectorizable(x)[0]


def gelu_tanh_with_derivative_vectorizable(x):
    """(gelu_tanh(x), gelu_tanh'(x)) in x's dtype; the overload below is what the kernels compile.
    With s = sigmoid(z), z = 2u: gelu_tanh = x s, and gelu_tanh' = s + x s (1 - s) dz/dx,
    dz/dx = 2 sqrt(2/π) (1 + 3 * 0.044715 x²)."""
    z = GELU_TANH_TWO_SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)
    s = 1.0 / (1.0 + math.exp(-z))
    slope = GELU_TANH_TWO_SQRT_2_OVER_PI * (1.0 + GELU_TANH_THREE_CUBIC * x * x)
    return x * s, s + x * s * (1.0 - s) * slope


@njit(cache=True)
def exp_float32(x):
    if x != x:
        return x
    clamped = EXP_F32_LOW if x < EXP_F32_LOW else (EXP_F32_HIGH if x > EXP_F32_HIGH else x)
    n = np.floor(clamped * EXP_F32_LOG2E + F32_HALF)
    r = clamped - n * EXP_F32_LN2_HIGH - n * EXP_F32_LN2_LOW
    c0, c1, c2, c3, c4, c5 = EXP_F32_POLYNOMIAL
    p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    p = p * r * r + r + F32_ONE
    return p * np.int32((np.int32(n) + 127) << 23).view(np.float32)


@overload(exp_vectorizable)
def exp_vectorizable_overload(x):
    if x == types.float32:
        return lambda x: exp_float32(x)
    return lambda x: math.exp(x)


@overload(sigmoid_vectorizable)
def sigmoid_vectorizable_overload(x):
    if x == types.float32:
        return lambda x: F32_ONE / (F32_ONE + exp_float32(-x))
    return lambda x: 1.0 / (1.0 + math.exp(-x))


@njit(cache=True)
def gelu_tanh_gate_float32(x):
    # (s, 1 - s) with s = sigmoid(2u) of a float32 x, the gate in gelu_tanh(x) = x s. 1 - s is
    # e s, e = exp(-2u) (finite: exp_float32 clamps it), without the cancellation of 1 - s near s = 1
    z = F32_GELU_TANH_TWO_SQRT_2_OVER_PI * (x + F32_GELU_TANH_CUBIC * x * x * x)
    e = exp_float32(-z)
    s = F32_ONE / (F32_ONE + e)
    return s, e * s


@njit(cache=True)
def gelu_tanh_gate_float64(x):
    # as gelu_tanh_gate_float32; here exp may overflow to inf (s = 0), so 1 - s is taken directly
    z = GELU_TANH_TWO_SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)
    s = 1.0 / (1.0 + math.exp(-z))
    return s, 1.0 - s


@overload(gelu_tanh_vectorizable)
def gelu_tanh_vectorizable_overload(x):
    if x == types.float32:
        return lambda x: x * gelu_tanh_gate_float32(x)[0]
    return lambda x: x * gelu_tanh_gate_float64(x)[0]


@overload(gelu_tanh_with_derivative_vectorizable)
def gelu_tanh_with_derivative_vectorizable_overload(x):
    if x == types.float32:

        def float32_impl(x):
            s, one_minus_s = gelu_tanh_gate_float32(x)
            slope = F32_GELU_TANH_TWO_SQRT_2_OVER_PI * (F32_ONE + F32_GELU_TANH_THREE_CUBIC * x * x)
            return x * s, s + x * s * one_minus_s * slope

        return float32_impl

    def float64_impl(x):
        s, one_minus_s = gelu_tanh_gate_float64(x)
        slope = GELU_TANH_TWO_SQRT_2_OVER_PI * (1.0 + GELU_TANH_THREE_CUBIC * x * x)
        return x * s, s + x * s * one_minus_s * slope

    return float64_impl


@njit(cache=True, fastmath={"reassoc"})
def sum_float64(x):
    # the sum of a 1-D array, accumulated in float64; reassociation lets LLVM keep a vector of
    # partial sums (a fixed order for a given build, so deterministic)
    total = 0.0
    for i in range(x.shape[0]):
        total += x[i]
    return total


@njit(cache=True, fastmath={"reassoc"})
def dot_float64(x, y):
    # sum_i x[i] y[i] of two 1-D arrays, products and sum in float64, vectorized as sum_float64
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * np.float64(y[i])
    return total


@njit(cache=True, fastmath={"reassoc"})
def weighted_dot_float64(x, y, weight):
    # sum_i x[i] y[i] weight[i] of three 1-D arrays, in float64, vectorized as sum_float64
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * np.float64(y[i]) * np.float64(weight[i])
    return total


@njit(cache=True, fastmath={"reassoc"})
def unit_offset_weighted_dot_float64(x, y, weight):
    # sum_i x[i] y[i] (1 + weight[i]) of three 1-D arrays, in float64, vectorized as sum_float64; the
    # gain 1 + weight[i] is rounded to weight's dtype first, as the unit-offset RMSNorm forward uses it
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * np.float64(y[i]) * np.float64(weight[i] + F32_ONE)
    return total


@njit(cache=True)
def max_value(x, lanes):
    # the largest element of a non-empty 1-D array; lanes is (MAX_LANES,) scratch in x's dtype. The
    # running max is kept per lane, so consecutive compares are independent. With a NaN in x the
    # result is NaN or the largest other element: callers meet the NaN again in their exp and sum.
    n_full = x.shape[0] // MAX_LANES * MAX_LANES
    if n_full == 0:
        best = x[0]
    else:
        for k in range(MAX_LANES):
            lanes[k] = x[k]
        for start in range(MAX_LANES, n_full, MAX_LANES):
            for k in range(MAX_LANES):
                v = x[start + k]
                lanes[k] = v if v > lanes[k] else lanes[k]
        best = lanes[0]
        for k in range(1, MAX_LANES):
            best = lanes[k] if lanes[k] > best else best
    for i in range(n_full, x.shape[0]):
        best = x[i] if x[i] > best else best
    return best


@njit(inline="always", fastmath={"contract", "reassoc"})
def dots_4x4(a0, a1, a2, a3, b0, b1, b2, b3, length):
    # the 16 dot products a_i · b_j over k < length of 4 rows against 4 others, as (a0·b0, a0·b1,
    # a0·b2, a0·b3, a1·b0, ..., a3·b3): 16 sums in registers over k, so one load of a row feeds 4
    # products. Each sum starts at its k = 0 product, which gives it the rows' dtype without a
    # literal. A matrix product's register block (few_rows_product, attention's scores). Inlined
    # into its callers, so that a constant length (attention's head_dim) stays a constant trip
    # count: called, the attention kernels ran 12-17% slower.
    s00, s01, s02, s03 = a0[0] * b0[0], a0[0] * b1[0], a0[0] * b2[0], a0[0] * b3[0]
    s10, s11, s12, s13 = a1[0] * b0[0], a1[0] * b1[0], a1[0] * b2[0], a1[0] * b3[0]
    s20, s21, s22, s23 = a2[0] * b0[0], a2[0] * b1[0], a2[0] * b2[0], a2[0] * b3[0]
    s30, s31, s32, s33 = a3[0] * b0[0], a3[0] * b1[0], a3[0] * b2[0], a3[0] * b3[0]
    for k in range(1, length):
        u0, u1, u2, u3 = b0[k], b1[k], b2[k], b3[k]
        v = a0[k]
        s00 += v * u0
        s01 += v * u1
        s02 += v * u2
        s03 += v * u3
        v = a1[k]
        s10 += v * u0
        s11 += v * u1
        s12 += v * u2
        s13 += v * u3
        v = a2[k]
        s20 += v * u0
        s21 += v * u1
        s22 += v * u2
        s23 += v * u3
        v = a3[k]
        s30 += v * u0
        s31 += v * u1
        s32 += v * u2
        s33 += v * u3
    return s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33
