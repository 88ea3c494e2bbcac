"""The thread-pool policy holds whatever was imported before pyml (pyml/thread_pools.py).

Each case runs in a fresh interpreter that imports torch before or after the generated package,
runs the model's forward, and then reports the mechanism, never a duration:
- which libgomp numba's parallel kernels run on: the one whose `omp_get_level()` is 1 inside a
  `prange` body. It must not be one that was loaded before pyml set GOMP_SPINCOUNT (torch's, put
  in the global symbol scope by `import torch`), and where the library can say (`omp_display_env`,
  OpenMP 5.1) its spin count must be pyml's;
- every loaded OpenBLAS's thread timeout, which must be the one pyml sets, numpy's included,
  although `import torch` loaded numpy before pyml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyml.thread_pools import THREAD_POOL_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import ctypes, json, sys
from threadpoolctl import ThreadpoolController

def loaded(api):
    return {pool.filepath: pool for pool in ThreadpoolController().select(internal_api=api).lib_controllers}

if sys.argv[1] == "torch_first":
    import torch
before_pyml = set(loaded("openmp"))
import numpy as np
import pyml
package = pyml.compile("specs/llama_tiny.toml")
if sys.argv[1] == "torch_after":
    import torch

package.Model.initialized(seed=0).forward(np.zeros((1, 4), np.int64))

import numba
from numba import njit, prange

def level_inside_numba(path):
    level = ctypes.CDLL(path).omp_get_level
    level.restype, level.argtypes = ctypes.c_int, []

    @njit(parallel=True)
    def levels(out):
        for i in prange(out.shape[0]):
            out[i] = level()

    out = np.zeros(8, np.int32)
    levels(out)
    return int(out.max())

openmp = loaded("openmp")
bound = [path for path in openmp if level_inside_numba(path) == 1]
policy = None
if bound and hasattr(ctypes.CDLL(bound[0]), "omp_display_env"):
    sys.stderr.flush()
    ctypes.CDLL(bound[0]).omp_display_env(1)  # prints the ICVs, libgomp's own too, to C's stderr
timeouts = {}
for path, pool in loaded("openblas").items():
    pool.dynlib.openblas_thread_timeout.restype = ctypes.c_uint
    timeouts[path] = pool.dynlib.openblas_thread_timeout()
print(json.dumps({"layer": numba.threading_layer(), "openmp": sorted(openmp), "bound": bound,
                  "loaded_before_pyml": sorted(before_pyml), "openblas_timeouts": timeouts,
                  "torch": "torch" in sys.modules}))
"""


def pools_after(order: str) -> tuple[dict, str]:
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    result = subprocess.run([sys.executable, "-c", CHILD, order], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize("order", ["torch_first", "torch_after", "no_torch"])
def test_numba_runs_on_a_libgomp_that_spins_briefly_and_openblas_sleeps(order):
    report, stderr = pools_after(order)
    assert report["torch"] == (order != "no_torch")
    assert report["layer"] == "omp"
    # exactly one libgomp runs numba's kernels, and it started after pyml set the spin count
    assert len(report["bound"]) == 1, report
    assert report["bound"][0] not in report["loaded_before_pyml"], report
    if order == "torch_first":
        # the trap this guards against: torch's own libgomp, loaded first, is in the process
        assert any("torch" in path for path in report["loaded_before_pyml"]), report
    if "GOMP_SPINCOUNT" in stderr:  # the bound libgomp could display its settings
        assert f"GOMP_SPINCOUNT = '{THREAD_POOL_ENVIRONMENT['GOMP_SPINCOUNT']}'" in stderr, stderr
    assert report["openblas_timeouts"], report  # numpy's at least
    assert set(report["openblas_timeouts"].values()) == {4}, report
