"""The vectorizable scalar math of the CPU kernels (`pyml/package/vector_math.py`) against
float64 references: exp within 1 ulp in float32 (and libm's exp exactly in float64), NaN passing
through, the float64 sum and the lane-wise max on lengths that are and are not multiples of the
lane count."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit

from pyml.package import vector_math


@pytest.fixture(scope="module")
def k():
    return vector_math


@pytest.fixture(scope="module")
def exp_all(k):
    exp_vectorizable = k.exp_vectorizable

    @njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_vectorizable(x[i])

    return apply


def ulps(actual, exact):
    return np.abs(actual.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))


def test_exp_float32_within_one_ulp(exp_all):
    x = np.linspace(-87.0, 88.0, 1_000_003).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-30, -1e-30, 88.0, -87.0])])
    out = np.empty_like(x)
    exp_all(x, out)
    assert ulps(out, np.exp(x.astype(np.float64))).max() <= 1.0


def test_exp_float32_edges(exp_all):
    x = np.float32([np.nan, -np.inf, -200.0, 200.0, np.inf])
    out = np.empty_like(x)
    exp_all(x, out)
    assert np.isnan(out[0])
    # below the clamp: exp(-87) = 1.6e-38 stands in, as the module's comment says
    assert 0.0 < out[1] == out[2] < 2e-38
    assert out[3] == out[4] == np.float32(math.exp(88.0))


def test_exp_float64_is_libm(exp_all):
    x = np.random.default_rng(0).uniform(-700.0, 700.0, 10_000)
    out = np.empty_like(x)
    exp_all(x, out)
    assert np.array_equal(out, np.array([math.exp(v) for v in x]))


def test_sigmoid(k):
    sigmoid_vectorizable = k.sigmoid_vectorizable

    @njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = sigmoid_vectorizable(x[i])

    x64 = np.linspace(-90.0, 90.0, 100_001)
    exact = 1.0 / (1.0 + np.exp(-x64))
    out64 = np.empty_like(x64)
    apply(x64, out64)
    np.testing.assert_allclose(out64, exact, rtol=1e-15, atol=0)
    x32 = x64.astype(np.float32)
    out32 = np.empty_like(x32)
    apply(x32, out32)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, 1.0 / (1.0 + np.exp(-x32.astype(np.float64))), rtol=3e-7,
                               atol=1e-37)


@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 31, 32, 33, 128, 49152])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_and_sum(k, length, dtype):
    rng = np.random.default_rng(length)
    lanes = np.empty(k.MAX_LANES, dtype)
    for trial in range(3):
        x = (rng.standard_normal(length) * 10).astype(dtype)
        x[rng.integers(length)] = 50.0 + trial  # the maximum anywhere, including the tail
        assert k.max_value(x, lanes) == x.max()
        total = k.sum_float64(x)
        assert abs(total - math.fsum(x.astype(np.float64))) <= 1e-12 * np.abs(x).sum()
