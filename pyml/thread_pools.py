"""The thread-pool policy pyml puts in force on its first import, whatever was imported before it.

Numba's parallel kernels run on OpenMP (libgomp) and the matrix products on OpenBLAS: thread pools
on the same cores, used in turn. By default both spin after their work, starving the pool that runs
next: libgomp's spinning made a one-token decode step take 800 ms instead of 30 ms on 2 cores, and
OpenBLAS's made the Numba kernels after each matrix product slower. So pyml wants both to sleep at
once: `OMP_WAIT_POLICY=PASSIVE`, `OPENBLAS_THREAD_TIMEOUT=4`. Both are read by each library when it
loads, so setting them is enough only if nothing loaded the libraries before pyml. `import torch`
does, and two things then go wrong (measured 2026-12-01, SmolLM2 training step 0.95 s alone, 2.9 s
with torch imported first):

- torch loads its own libgomp into the process's global symbol scope (`libtorch_global_deps`,
  RTLD_GLOBAL), before pyml set the wait policy. Numba's OpenMP pool (`omppool`) links the system's
  `libgomp.so.1.0.0`, but a symbol is looked up in the global scope first, so its `GOMP_parallel`
  binds to torch's libgomp, which spins after every kernel. pyml therefore loads `omppool` itself,
  with RTLD_DEEPBIND: its symbols bind to the libgomp it links, which loads now, after the variable
  is set. Numba later imports the same, already loaded, file.
- `import torch` imports numpy, whose OpenBLAS started its threads with the default timeout. Its
  `openblas_read_env` re-reads the variables and `blas_thread_shutdown_` stops the threads; the
  next BLAS call starts them again with the short timeout.
"""

import ctypes
import glob
import importlib.util
import os

THREAD_POOL_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
# the ones the user had not set: `user_environment` leaves them out again
SET_ON_IMPORT = tuple(name for name in THREAD_POOL_ENVIRONMENT if name not in os.environ)

# the loaded `omppool`, kept so that it is never unloaded; None where numba has no OpenMP layer
numba_openmp_pool = None


def user_environment() -> dict[str, str]:
    """os.environ as the user gave it: without the settings pyml made on import. The benchmarks run
    each system from it, so PyTorch is measured with its own defaults, not pyml's."""
    return {name: value for name, value in os.environ.items() if name not in SET_ON_IMPORT}


def numba_openmp_pool_path() -> str | None:
    """Numba's OpenMP pool library, found without importing numba (that takes a second)."""
    spec = importlib.util.find_spec("numba")
    if spec is None or spec.origin is None:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "np", "ufunc", "omppool*.so"))
    return found[0] if found else None


def bind_numba_openmp_pool() -> None:
    """Load numba's OpenMP pool so that it binds to the libgomp it links (see the module's doc).
    If numba already started its threads, the file is loaded and bound: nothing changes. Only
    glibc has a global scope that a library loaded earlier can take over (macOS binds a library's
    symbols to the libraries it links), and RTLD_DEEPBIND with it."""
    global numba_openmp_pool
    path = numba_openmp_pool_path()
    if path is not None and hasattr(os, "RTLD_DEEPBIND"):
        numba_openmp_pool = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_DEEPBIND)


def restart_loaded_openblas() -> None:
    """Make every OpenBLAS loaded before pyml read the timeout: re-read the variables, and stop its
    threads where the timeout changed (they restart on the next call). No BLAS call may be running
    in another thread meanwhile; at import time none of pyml's is."""
    from threadpoolctl import ThreadpoolController

    for pool in ThreadpoolController().select(internal_api="openblas").lib_controllers:
        library = pool.dynlib
        try:
            timeout, read_env, shutdown = (library.openblas_thread_timeout,
                                           library.openblas_read_env, library.blas_thread_shutdown_)
        except AttributeError:  # an OpenBLAS without its thread server (built for OpenMP)
            continue
        timeout.restype = ctypes.c_uint
        before = timeout()
        read_env()
        if timeout() != before:
            shutdown()


def put_in_force() -> None:
    for name in SET_ON_IMPORT:
        os.environ[name] = THREAD_POOL_ENVIRONMENT[name]
    bind_numba_openmp_pool()
    restart_loaded_openblas()
