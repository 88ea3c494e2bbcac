"""Block-wide sums in a fixed order, shared by the CUDA kernels that reduce a row in one block."""

from numba import cuda


@cuda.jit(device=True)
def block_sum(partial, value):
    # the sum of `value` over the block's threads (as many as partial's length, a power of two),
    # via the shared array `partial`: a tree in a fixed order, so the sum is deterministic
    tid = cuda.threadIdx.x
    partial[tid] = value
    cuda.syncthreads()
    stride = partial.shape[0] // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = partial[0]
    cuda.syncthreads()
    return total
