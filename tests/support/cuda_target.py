"""Where the CUDA case files (tests/cuda/*_cases.py) run: Numba's CUDA simulator, the default and
all that CI here has, or a real NVIDIA GPU, chosen by one switch:

    PYML_CUDA_TARGET=device python -m pytest tests/cuda       (bench/gpu_check.sh: a file at a time)

Importing this module sets NUMBA_ENABLE_CUDASIM from the switch, so a case file imports it before
anything imports numba: Numba reads the variable once, when numba.cuda is first imported. The main
pytest process never imports it; its children do (tests/support/cuda_simulator.py).
"""

from __future__ import annotations

import os

SWITCH = "PYML_CUDA_TARGET"
TARGETS = ("simulator", "device")
TARGET = os.environ.get(SWITCH, "simulator")
if TARGET not in TARGETS:
    raise SystemExit(f"{SWITCH}={TARGET!r}: expected one of {', '.join(TARGETS)}")
SIMULATED = TARGET == "simulator"
os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if SIMULATED else "0"


def check_target() -> None:
    """What runs is the target the switch asked for: the simulator's kernels and arrays, or a GPU
    that Numba found (never a silent fall back to the simulator, which would pass for the device)."""
    import numpy as np
    from numba import config, cuda

    assert config.ENABLE_CUDASIM == int(SIMULATED), config.ENABLE_CUDASIM
    array_module = type(cuda.to_device(np.zeros(1))).__module__
    if SIMULATED:
        assert "simulator" in array_module, array_module
    else:
        assert cuda.is_available(), f"{SWITCH}=device, but Numba finds no CUDA GPU"
        assert "simulator" not in array_module, array_module


def kernel_is_targets(kernel) -> bool:
    """Whether a @cuda.jit kernel is the target's: the simulator's, or one of Numba's dispatchers."""
    return ("simulator" in type(kernel).__module__) == SIMULATED


# The routes of the linear layers' products (pyml/package/cuda_products.py) the cases run: the
# tiled kernel everywhere, and cuBLAS on a GPU (the simulator has none).
PRODUCT_ROUTES = ("kernels",) if SIMULATED else ("kernels", "cublas")
