"""pyml: declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels that train it."""

import os

# Numba's parallel kernels run on OpenMP (libgomp) and the matrix products on OpenBLAS: two thread
# pools on the same cores, used in turn. libgomp's default is to spin after a parallel region,
# which starves the BLAS threads that run next (a one-token decode step went from 30 ms to 800 ms
# on 2 cores). Passive waiting must be chosen before libgomp loads, hence here, on first import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
