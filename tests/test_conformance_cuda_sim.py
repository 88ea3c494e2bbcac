"""Runs tests/conformance_cuda_cases.py (CUDA kernels vs the exact model) in a child pytest process.

NUMBA_ENABLE_CUDASIM=1 only works if set before numba.cuda is first imported, and pytest imports all
test modules of a session before running any, so the CUDA cases get a fresh interpreter of their own
(the same approach as tests/test_kernels_cuda_sim.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_cuda_kernels_equal_exact_model_under_simulator():
    """Every CUDA kernel of a linear map equals the Python mirror of the Lean exact model bit for bit
    on small-integer float64 inputs (the laws each case links are in conformance_cuda_cases.py)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "conformance_cuda_cases.py"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
