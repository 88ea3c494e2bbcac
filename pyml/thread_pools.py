"""The thread-pool policy pyml puts in force on its first import, whatever was imported before it.

Numba's parallel kernels run on OpenMP (libgomp) and the matrix products on OpenBLAS: thread pools
on the same cores, used in turn. What a pool's threads do between two pieces of work decides the
speed on a small machine, both ways (measured on the 2-core development machine, 2026-12-01):

- Spinning long starves the pool that runs next. libgomp's default (300000 spins, a few
  milliseconds) made a one-token decode step take 800 ms instead of 30 ms when its products were
  OpenBLAS's, and OpenBLAS's own spinning slowed the Numba kernels after each product.
- Sleeping at once makes every parallel loop wake its threads, and on a virtual machine whose idle
  cores halt (this one: cpuidle haltpoll with guest_halt_poll_ns=0) a wake-up passes through the
  hypervisor: a parallel loop cost 65 to 110 us with libgomp's OMP_WAIT_POLICY=PASSIVE against
  1.3 us with a short spin. The fused decode step runs about 150 parallel loops per SmolLM2
  token: 52 tokens/s passive, 103 with the short spin; a training step took the same time
  (1.18 s) both ways.

So pyml asks numba's libgomp for a short spin, `GOMP_SPINCOUNT=3000` (libgomp counts about
100000 spins per millisecond: tens of microseconds, which covers the gaps between one token's
kernels and ends before a BLAS product needs the core; the count overrides OMP_WAIT_POLICY, which
pyml sets to PASSIVE for every other OpenMP runtime), and OpenBLAS for its shortest,
`OPENBLAS_THREAD_TIMEOUT=4`. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept. Both libraries read the variables when
they load, so setting them is enough only if nothing loaded the libraries before pyml. `import
torch` does, and two things then go wrong (measured 2026-12-01, SmolLM2 training step 0.95 s
alone, 2.9 s with torch imported first):

- torch loads its own libgomp into the process's global symbol scope (`libtorch_global_deps`,
  RTLD_GLOBAL), before pyml set the spin count. Numba's OpenMP pool (`omppool`) links the system's
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

THREAD_POOL_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000",
                           "OPENBLAS_THREAD_TIMEOUT": "4"}
# what else steers each: a user who set it chose the library's waiting
USER_CHOICES = {"OMP_WAIT_POLICY": ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"),
                "GOMP_SPINCOUNT": ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"),
                "OPENBLAS_THREAD_TIMEOUT": ("OPENBLAS_THREAD_TIMEOUT",)}
# the ones the user had not chosen: `user_environment` leaves them out again
SET_ON_IMPORT = tuple(name for name in THREAD_POOL_ENVIRONMENT
                      if not any(choice in os.environ for choice in USER_CHOICES[name]))
# set only while numba's libgomp loads: the short spin is tuned to pyml's kernels, and an OpenMP
# runtime that starts later in the process (one that torch or a BLAS starts on first use) would read
# it too; those see OMP_WAIT_POLICY=PASSIVE, as they did before pyml spun at all
FOR_NUMBA_ONLY = ("GOMP_SPINCOUNT",)

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
    bind_numba_openmp_pool()  # its libgomp reads the variables as it loads
    for name in FOR_NUMBA_ONLY:
        if name in SET_ON_IMPORT:
            del os.environ[name]
    restart_loaded_openblas()
