"""Runs tests/generated_cuda_sim_cases.py, generated models on device="cuda", in a child pytest
process under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 only works if set before numba.cuda is
first imported, and pytest imports every test module of a session before running any)."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_generated_models_on_cuda_under_the_simulator_equal_the_cpu():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(TESTS / "generated_cuda_sim_cases.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
