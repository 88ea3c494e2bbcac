"""Runs tests/cuda_sim_cases.py (CUDA kernels vs CPU kernels) in a child pytest process.

NUMBA_ENABLE_CUDASIM=1 only works if set before numba.cuda is first imported, and pytest imports all
test modules of a session before running any, so the CUDA cases get a fresh interpreter of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_cuda_kernels_match_cpu_under_simulator():
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
            str(TESTS / "cuda_sim_cases.py"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
