"""pyml: declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels that train it."""

import os

# Numba's parallel kernels run on OpenMP (libgomp) and the matrix products on OpenBLAS: two thread
# pools on the same cores, used in turn. By default both spin after their work, starving the pool
# that runs next: libgomp's spinning made a one-token decode step take 800 ms instead of 30 ms on 2
# cores, and OpenBLAS's made the Numba kernels after each matrix product about 2x slower (training
# step 1.51 s -> 1.42 s with the short timeout). Both are read when the libraries load, so they are
# set here, on pyml's first import, which generated packages and the CLI do before importing numpy.
THREAD_POOL_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
# the ones the user had not set: `user_environment` leaves them out again
SET_ON_IMPORT = tuple(name for name in THREAD_POOL_ENVIRONMENT if name not in os.environ)
for name in SET_ON_IMPORT:
    os.environ[name] = THREAD_POOL_ENVIRONMENT[name]


def user_environment() -> dict[str, str]:
    """os.environ as the user gave it: without the settings pyml made on import. The benchmarks run
    each system from it, so PyTorch is measured with its own defaults, not pyml's."""
    return {name: value for name, value in os.environ.items() if name not in SET_ON_IMPORT}

__version__ = "0.1.0"
