"""The CUDA kernels and the generated models on device="cuda", under Numba's CUDA simulator: each
case file's child pytest run (started in the background when the session's tests are collected,
tests/support/cuda_simulator.py) must pass. The children run with NUMBA_ENABLE_CUDASIM=1, and the kernel
case files check that what runs is the simulator's kernels; on a machine with a GPU, run
generated_cuda_sim_cases.py directly, without the variable, to test the device."""

import pytest

from tests.support import cuda_simulator


@pytest.mark.parametrize("cases", cuda_simulator.CASE_FILES)
def test_cuda_cases_under_simulator(cases):
    status, output = cuda_simulator.runs.result(cases)
    assert status == 0, output[-9000:]
