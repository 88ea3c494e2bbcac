"""Runs the CUDA cases in a child pytest process under Numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM=1 only works if set before numba.cuda is first imported, and pytest imports all
test modules of a session before running any, so the CUDA cases get a fresh interpreter of their own.
- cuda_sim_cases.py: every CUDA kernel equals the CPU kernel, forward and backward, in float64 and
  float32; it checks that the kernels it runs are the simulator's.
- conformance_cuda_cases.py: every CUDA kernel of a linear map equals the Python mirror of the Lean
  exact model bit for bit on small-integer float64 inputs (the laws each case links are named there).
- fuzz_cuda_cases.py: generated packages of random specs and of the fuzz corpus on device="cuda"
  against the torch reference.
Both files set the variable themselves, so they test the simulator, not a real device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.mark.parametrize("cases", ["cuda_sim_cases.py", "conformance_cuda_cases.py",
                                   "fuzz_cuda_cases.py"])
def test_cuda_cases_under_simulator(cases):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / cases)],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
