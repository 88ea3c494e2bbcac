"""What every generated CUDA decode step (gen/<name>/decode_cuda.py) calls besides its package's own
kernels: the linear map of one row on weights in any kept format, the KV cache's slot of a
position and the write into it, and a bias. It decodes one sequence per step.

A linear op's weights are split arrays (pyml/generate/cuda_weights.py builds them) copied to the
device by `device_weight`: (kinds, packed, high, scale, offset, dense), `kinds` the kind of each
layer (int64), staying on the host, where `linear_row` reads the kind of a layer to pick the loop
the kernel runs, and each array stacked by layer (layers, rows, ...), C-contiguous, as wide as its
widest layer (Q4_K and Q6_K layers share a stack):

    kind             packed (uint8)             high (uint8)   scale, offset (float32)   dense
    Q4_RUNS_OF_16    Q4_0 / Q4_1 nibbles, in/2  -              per 32 values             -
    Q4_RUNS_OF_32    Q4_K nibbles, in/2         -              per 32 values             -
    Q5               Q5_0 low nibbles, in/2     fifth bits     per 32 values             -
    Q8               Q8_0 int8 bytes, in        -              scale per 32              -
    Q6               Q6_K low nibbles, in/2     2-bit highs    scale per 16              -
    DENSE            -                          -              -                         float32, in

(pyml/formats/gguf_quantized.py describes the layouts; "-" is an array of width 0.) The CPU step's
int8 activations (--activations q8_0) have no kind here: the rounding buys a CPU its integer
dot-product instructions, and a GPU reads the weights from memory fast enough without it.

A row's products are summed by one warp: thread t takes the weights t, t + 32, ... of the row,
dequantized as gguf does (pyml/package/quantized_cuda.py), so a warp reads consecutive bytes, and
`block_sum` adds the 32 partial sums in a fixed order. The sums are in the output's dtype (float32,
or float64 for a float64 model's dense rows).
"""

from functools import cache

import numpy as np
from numba import cuda, njit

from pyml.errors import PymlError
from pyml.package.quantized_cuda import THREADS, block_sum, q4_weight, q5_weight, q6_weight, q8_weight

# the kind of each layer of a weight (`kinds`), the table above
Q4_RUNS_OF_16, Q4_RUNS_OF_32, Q5, Q8, Q6, DENSE = range(6)
CUDA_KINDS = (Q4_RUNS_OF_16, Q4_RUNS_OF_32, Q5, Q8, Q6, DENSE)


@njit(cache=True)
def cache_slot(window, position):
    """(the slot position `position` is written to, how many slots hold positions): a global layer
    has a slot per position, a sliding one its window, position p in slot p % window; the same
    rule as pyml.package.base.KVCache.cache_slot, which the prompt's cache was filled by."""
    if window:
        return position % window, min(position + 1, window)
    return position, position + 1


@cache
def linear_row_kernel(dtype):
    """y[0, row] = sum_k W[row, k] x[0, k] for the block's row, W layer-kind `kind`'s arrays, the
    sum kept in `dtype`."""

    @cuda.jit
    def kernel(kind, packed, high, scale, offset, dense, x, y):
        partial = cuda.shared.array(THREADS, dtype)
        row, first = cuda.blockIdx.x, cuda.threadIdx.x
        total = dtype(0)
        columns = x.shape[1]
        if kind == Q4_RUNS_OF_16:
            for k in range(first, columns, THREADS):
                total += q4_weight(packed, scale, offset, row, k, 16) * x[0, k]
        elif kind == Q4_RUNS_OF_32:
            for k in range(first, columns, THREADS):
                total += q4_weight(packed, scale, offset, row, k, 32) * x[0, k]
        elif kind == Q5:
            for k in range(first, columns, THREADS):
                total += q5_weight(packed, high, scale, offset, row, k) * x[0, k]
        elif kind == Q8:
            for k in range(first, columns, THREADS):
                total += q8_weight(packed, scale, row, k) * x[0, k]
        elif kind == Q6:
            for k in range(first, columns, THREADS):
                total += q6_weight(packed, high, scale, row, k) * x[0, k]
        else:
            for k in range(first, columns, THREADS):
                total += dense[row, k] * x[0, k]
        total = block_sum(partial, total)
        if first == 0:
            y[0, row] = total

    return kernel


def device_weight(weight: tuple) -> tuple:
    """A step weight tuple (pyml.generate.quantized.weight_tuple) on the device."""
    kinds, packed, high, scale, offset, dense = weight
    unknown = sorted({int(kind) for kind in kinds} - set(CUDA_KINDS))
    if unknown:
        raise PymlError("--activations q8_0 runs on the CPU only: leave it out to decode on the GPU")
    return (np.asarray(kinds), *(cuda.to_device(array) for array in (packed, high, scale, offset, dense)))


def linear_row(weight, layer, x, y):
    """y[0] = W x[0], W layer `layer` of `weight` (a `device_weight`); x is (1, in), y (1, out)."""
    kinds, packed, high, scale, offset, dense = weight
    linear_row_kernel(np.dtype(y.dtype).type)[y.shape[1], THREADS](
        int(kinds[layer]), packed[layer], high[layer], scale[layer], offset[layer], dense[layer], x, y)


@cuda.jit
def add_bias_kernel(y, bias):
    i = cuda.grid(1)
    if i < y.shape[1]:
        y[0, i] += bias[i]


def add_bias(y, bias):
    add_bias_kernel[(y.shape[1] + 127) // 128, 128](y, bias)


@cuda.jit
def store_slot_kernel(cache, slot, x):
    head, i = cuda.blockIdx.x, cuda.threadIdx.x
    cache[0, slot, head, i] = x[0, 0, head, i]


def store_slot(cache, slot, x):
    """cache[0, slot] = x[0, 0]: one position's keys or values (1, 1, kv heads, head dim) into
    slot `slot` of a layer's cache (1, slots, kv heads, head dim)."""
    store_slot_kernel[x.shape[2], x.shape[3]](cache, slot, x)

