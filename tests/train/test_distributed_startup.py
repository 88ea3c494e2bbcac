"""A rank's start and its end by error, as a new user meets them: `pyml train --ranks 2` from a
cold cache with no thread settings of the user's (the runs in test_distributed.py set one thread
per rank themselves, which hid the first), and an error on one rank that MPI_Abort did not end."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pyml.train import distributed
from tests.train.test_distributed import mpiexec_program

ROOT = Path(__file__).resolve().parents[2]
THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def test_sharing_the_cores_after_numbas_threads_started_leaves_compiling_possible():
    """Numba's compiler re-reads NUMBA_NUM_THREADS before each compilation and raises once its
    threads run: a rank must share its cores without changing it."""
    code = textwrap.dedent("""
        import numpy as np
        import numba
        from numba import njit, prange
        from pyml.train.distributed import share_cores

        @njit(parallel=True)
        def total(values):
            result = 0.0
            for i in prange(values.size):
                result += values[i]
            return result

        total(np.ones(8))  # Numba's threads start
        share_cores(2)

        @njit
        def compiled_after(x):
            return x + 1

        from threadpoolctl import threadpool_info
        print(compiled_after(1), numba.get_num_threads(),
              sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}))
    """)
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
    job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert job.returncode == 0, job.stderr
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert job.stdout.split(maxsplit=2) == ["2", str(share), f"[{share}]\n"]


def test_two_ranks_train_from_a_cold_cache_without_thread_settings(tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
    env |= {"PYML_CACHE": str(tmp_path / "cache"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    mpiexec_program()  # the anchor: --ranks finds mpiexec the same way
    job = subprocess.run(
        [sys.executable, "-m", "pyml.cli", "train", "--spec", str(ROOT / "specs" / "mlp_digits.toml"),
         "--steps", "3", "--batch", "64", "--dtype", "float64", "--ranks", "2", "--eval-every", "3",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    assert "trained to step 3" in job.stdout


class WorldWhoseAbortReturns:
    """An MPI world whose MPI_Abort returned (as one did on a busy machine)."""

    rank, size = 1, 2

    def __init__(self, peer_timeout):
        pass

    def abort(self, error):
        print(f"error: rank 1: {distributed.describe(error)}; stopping every rank", file=sys.stderr)


def test_an_error_on_a_rank_ends_it_with_status_2_even_when_mpi_abort_returns(monkeypatch, capsys):
    monkeypatch.setattr(distributed, "launched_world_size", lambda: 2)
    monkeypatch.setattr(distributed, "MpiWorld", WorldWhoseAbortReturns)
    with pytest.raises(SystemExit) as stopped:
        with distributed.process_group():
            raise RuntimeError("injected on rank 1")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: rank 1: RuntimeError: injected on rank 1; stopping every rank\n"
