"""The CUDA kernels and the generated models on device="cuda": each case file's child pytest run
(started in the background when the session's tests are collected, tests/support/cuda_simulator.py)
must pass. The children run under Numba's CUDA simulator, or on a GPU with PYML_CUDA_TARGET=device
(tests/support/cuda_target.py), and each case file checks that what runs is the target asked for."""

import pytest

from tests.support import cuda_simulator


@pytest.mark.parametrize("cases", cuda_simulator.CASE_FILES)
def test_cuda_cases(cases):
    status, output = cuda_simulator.runs.result(cases)
    assert status == 0, output[-9000:]
