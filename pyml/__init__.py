"""pyml: declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels that train it."""

# Before anything of pyml runs: thread pools that spin briefly after their work, then sleep, also
# when torch or numpy were imported first (pyml/thread_pools.py says why and how). Generated
# packages and the CLI import pyml before numpy, numba or the kernels.
from pyml.thread_pools import THREAD_POOL_ENVIRONMENT, put_in_force, user_environment

put_in_force()

__all__ = ["THREAD_POOL_ENVIRONMENT", "user_environment"]
__version__ = "0.1.0"
