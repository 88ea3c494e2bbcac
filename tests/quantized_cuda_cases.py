"""The quantized linear kernels' cases (tests/quantized_cases.py) on the CUDA kernels; run under
NUMBA_ENABLE_CUDASIM=1 by tests/test_quantized_linear.py, or directly on a machine with a GPU."""

from __future__ import annotations

import pytest
from conformance_cuda_cases import CUDA
from quantized_cases import TYPES, case_exact, case_real


@pytest.mark.parametrize("ggml", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(2))
def test_cuda_kernel_equals_the_exact_model(ggml, seed):
    case_exact(CUDA, ggml, seed)


@pytest.mark.parametrize("ggml", TYPES, ids=lambda t: t.name)
def test_cuda_kernel_equals_ggufs_dequantization_times_x(ggml):
    case_real(CUDA, ggml, 0)
