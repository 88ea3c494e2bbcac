"""Which routine runs the linear layers' matrix products on a GPU: pyml's tiled kernel
(`pyml.package.kernels_cuda.matmul_kernel`) or NVIDIA's cuBLAS, through CuPy.

    PYML_CUDA_PRODUCTS=kernels   the tiled kernel (the default): what Numba's CUDA simulator runs,
                                 and what the exact-model conformance tests hold bit for bit
    PYML_CUDA_PRODUCTS=cublas    cuBLAS's GEMM on the same device arrays, shared with CuPy through
                                 __cuda_array_interface__ (no copy), in float32 or float64 as the
                                 arrays are (CuPy multiplies float32 in TF32 only under CUPY_TF32=1)

The tiled kernel stays the default until a run on a real GPU (bench/gpu_check.sh) has held cuBLAS's
products to the CPU's and measured both. Every other kernel of a step (norms, attention, the
loss, AdamW) is pyml's own on either route. Both routes launch on the default stream, so a product
is ordered after the kernel that wrote its operands and before the one that reads its result.
"""

from __future__ import annotations

import functools
import os

from pyml.errors import PymlError

SWITCH = "PYML_CUDA_PRODUCTS"
ROUTES = ("kernels", "cublas")


@functools.cache
def cupy_module(simulated: bool):
    if simulated:
        raise PymlError(f"{SWITCH}=cublas runs on a GPU; Numba's CUDA simulator runs the kernels only")
    try:
        import cupy
    except ImportError:
        raise PymlError(f"{SWITCH}=cublas needs CuPy: pip install the cupy-cuda12x or cupy-cuda13x "
                        "that matches the CUDA of your driver") from None
    return cupy


def chosen_route() -> str:
    """The route PYML_CUDA_PRODUCTS names, read at each product (so a program may switch), checked:
    an unknown name, or cublas where CuPy or a GPU is missing, is a PymlError."""
    route = os.environ.get(SWITCH, "kernels")
    if route not in ROUTES:
        raise PymlError(f"{SWITCH}={route!r}: expected one of {', '.join(ROUTES)}")
    if route == "cublas":
        from numba import config

        cupy_module(bool(config.ENABLE_CUDASIM))
    return route


def cublas_matmul(layout, a, b, c):
    """c = A B through cuBLAS, A = a or a.T and B = b or b.T as `layout` ("nt", "nn", "tn") says:
    the transposes are views, which cuBLAS reads as its transposed operands."""
    from numba import config

    cupy = cupy_module(bool(config.ENABLE_CUDASIM))
    left, right = cupy.asarray(a), cupy.asarray(b)
    if layout[0] == "t":
        left = left.T
    if layout[1] == "t":
        right = right.T
    cupy.matmul(left, right, out=cupy.asarray(c))
