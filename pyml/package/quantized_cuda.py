"""The CUDA device functions that read one weight of a matrix kept quantized (the arrays of
pyml/formats/gguf_quantized.py), for the CUDA decode step's linear map (decode_cuda.py).

Each returns W[row, k] as gguf dequantizes it, q * scale + offset in float32, so the kernels that
multiply by it compute Lean law linear_input_adjoint's forward, matVec W v, on the block
dequantization W of the stored values. A kernel's threads read consecutive k, hence consecutive
bytes of a row. `block_sum` is the tree that adds a block's partial sums in a fixed order, so a
row's result does not depend on which thread finished first.

Bytes are widened to int32 before their bits are combined: Numba types `byte >> 4` as uint64 and
`byte & 15` as int64, and the two arms of a choice between them unify to float64, which has no `|`
(Numba refuses the kernel; the simulator, which computes with NumPy scalars, does not notice:
bench/cuda_ptx_check.py found it).
"""

import numpy as np
from numba import cuda

THREADS = 32  # a block's threads: one warp per output row


@cuda.jit(device=True)
def q4_weight(values, scale, offset, row, k, run):
    """4-bit values in runs of `run` bytes (Q4_0 and Q4_1: 16, Q4_K: 32): a run's low nibbles are
    its first `run` values, its high nibbles the next `run`."""
    position = k % (2 * run)
    packed = values[row, k // (2 * run) * run + position % run]
    q = (packed >> 4) if position >= run else (packed & 15)
    return np.float32(q) * scale[row, k // 32] + offset[row, k // 32]


@cuda.jit(device=True)
def q5_weight(values, high, scale, offset, row, k):
    """Q5_0: the low nibbles as Q4_0's, the fifth bit of value i of a block bit i % 8 of its byte
    i // 8 of `high`."""
    block, i = k // 32, k % 32
    packed = np.int32(values[row, 16 * block + i % 16])
    nibble = (packed >> 4) if i >= 16 else (packed & 15)
    fifth = (np.int32(high[row, 4 * block + i // 8]) >> (i % 8)) & 1
    return np.float32(nibble | (fifth << 4)) * scale[row, block] + offset[row, block]


@cuda.jit(device=True)
def q8_weight(values, scale, row, k):
    """Q8_0: one signed byte per value, whether the array holds them as int8 or as their bytes."""
    q = np.int32(values[row, k])
    if q > 127:
        q -= 256
    return np.float32(q) * scale[row, k // 32]


@cuda.jit(device=True)
def q6_weight(low, high, scale, row, k):
    """Q6_K: k = 128 h + 32 j + i is the low nibble of low byte 64 h + 32 (j % 2) + i (its high
    nibble for j >= 2) and bits 2j, 2j + 1 of high byte 32 h + i, less 32."""
    h, j, i = k // 128, k % 128 // 32, k % 32
    packed = np.int32(low[row, 64 * h + 32 * (j % 2) + i])
    nibble = (packed >> 4) if j >= 2 else (packed & 15)
    q = nibble | (((np.int32(high[row, 32 * h + i]) >> (2 * j)) & 3) << 4)
    return np.float32(np.int32(q) - 32) * scale[row, k // 16]


@cuda.jit(device=True)
def block_sum(partial, value):
    """The sum of `value` over the block's THREADS threads, through the shared array `partial`."""
    tid = cuda.threadIdx.x
    partial[tid] = value
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride //= 2
    return partial[0]
