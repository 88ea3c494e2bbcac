"""What every generated fused decode step (gen/<name>/decode_cpu.py) calls besides its package's own
kernels: the linear map of each sequence's row on weights in any kept format, and the thread
count of the pool's next parallel loops (the step wakes the pool for its matrix-vector products
and attention only).

A linear op's weights arrive as one tuple, the same types for every format, so that one compiled
step serves any mix of formats: (kinds, packed, high, scale, offset, dense), `kinds` the kind of
each layer (int64) and each weight array stacked by layer (layers, rows, ...), C-contiguous; a
model-level weight (the tied LM head) has one layer. The kinds Q4_RUNS_OF_16_X8 and Q8_X8 (`pyml
generate --activations q8_0`) round the op's input to int8 first
(quantized_dot.round_activations_q8), and multiply it by Q4_0/Q4_1 and Q8_0 weights repacked rows
by 16 (quantized_dot.py gives the layout; rows padded to a multiple of 16). Layers of different
kinds share a stack when their packed values have one width (Q4_K and Q6_K: in/2): each array is
as wide as its widest layer, and a kernel reads a row of scales or high bits from its start, so
the padding past a layer's own width is never read.

    kind             packed (uint8)             high (uint8)   scale, offset (float32)   dense
    Q4_RUNS_OF_16    Q4_0 / Q4_1 nibbles, in/2  -              per 32 values             -
    Q4_RUNS_OF_32    Q4_K nibbles, in/2         -              per 32 values             -
    Q5               Q5_0 low nibbles, in/2     fifth bits     per 32 values             -
    Q8               Q8_0 int8 bytes, in        -              scale per 32              -
    Q4_RUNS_OF_16_X8 Q4_0 / Q4_1, rows by 16     -              per 32, rows by 16, f16   -
    Q8_X8            Q8_0, rows by 16           -              per 32, rows by 16, f16   -
    Q6               Q6_K low nibbles, in/2     2-bit highs    scale per 16              -
    DENSE            -                          -              -                         float32, in

(pyml/formats/gguf_quantized.py describes the layouts; "-" is an array of width 0; "f16": float16
values in pairs in the float32 array's bytes, quantized_dot.py says where.) Q8_0's int8
values travel as their bytes: q8_row_dot loads them as signed 8-bit integers whatever the array's
dtype says. The row dot products are pyml/package/quantized_dot.py's, so a quantized linear map
is the same function here as in the quantized linear kernels (Lean law linear_input_adjoint's
forward, matVec W v, W the block dequantization of the stored values).

Numba's cache does not notice when a function a cached kernel calls changes in another file, so the
generated decode modules carry this module's and quantized_dot's hash in their first line (as for
vector_math). For the same reason `linear_row`, which calls quantized_dot's intrinsics, is not
cached itself: it is compiled into each generated step, whose cache that hash keeps fresh.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from pyml.package.quantized_dot import (
    QDOT_GROUP_ROWS,
    QDOT_INT8_SAMPLES,
    QDOT_SAMPLES,
    q4_q8_rows_by_16,
    q4_q8_rows_by_16_x4,
    q4_q8_rows_by_16_x8,
    q4_row_dot_runs_of_16,
    q4_row_dot_runs_of_32,
    q4_rows_dot_runs_of_16,
    q4_rows_dot_runs_of_32,
    q5_row_dot,
    q5_rows_dot,
    q6_row_dot,
    q6_rows_dot,
    q8_q8_rows_by_16,
    q8_q8_rows_by_16_x4,
    q8_q8_rows_by_16_x8,
    q8_row_dot,
    q8_rows_dot,
    round_activations_q8,
)

Q4_RUNS_OF_16, Q4_RUNS_OF_32, Q5, Q8, Q6, DENSE, Q4_RUNS_OF_16_X8, Q8_X8 = range(8)
FAST = {"contract", "reassoc"}

# The thread pool's symbols (get_num_threads, set_num_threads) are registered with LLVM when it
# starts (numba's private _launch_threads, which its own get_num_threads calls first); a cached
# step links against them by name.
_launch_threads()


@intrinsic
def pool_threads(typingctx):
    """numba.get_num_threads() for a cached function: numba's own calls the pool through a ctypes
    pointer, which a cached function may not hold; this calls the pool's symbol by name, as the
    parallel loops Numba compiles do."""

    def codegen(context, builder, signature, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []),
                                                  "get_num_threads")
        return builder.call(function, [])

    return types.intp(), codegen


@intrinsic
def use_pool_threads(typingctx, count):
    """numba.set_num_threads(count) for a cached function (see pool_threads): the number of the
    pool's threads the calling thread's next parallel loops run on, 1 <= count <= pool_threads()
    at the step's start (not checked: the step only passes 1 and that)."""
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        int32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [int32]),
                                                  "set_num_threads")
        builder.call(function, [builder.trunc(args[0], int32) if args[0].type.width > 32 else args[0]])
        return context.get_dummy_value()

    return types.none(count), codegen


@njit(parallel=True, fastmath=FAST)
def linear_row(weight, layer, x, y):
    """y[b] = W x[b] (+ nothing: a bias is added by the caller) for each row b, W layer `layer` of
    `weight`; x is (B, in), y (B, out) float32, one row per sequence of the step's batch. One
    output row per iteration of the parallel loop, for every sequence at once: each weight row is
    read from memory once per step, and dequantized once per QDOT_SAMPLES sequences, whatever B
    is; each y[b, row] is summed in the same order whether its sequence is taken alone or with
    others (quantized_dot.QdotSamples), so a sequence's result does not depend on its batch. The
    int8-activation kinds round every row of x on the calling thread, then take 16 output rows per
    iteration, their weights unpacked once per 8 sequences (then 4, then 1), each sequence's sums
    its own likewise. No BLAS, so no BLAS thread wakes up."""
    kinds, packed, high, scale, offset, dense = weight
    kind = kinds[layer]
    packed, high, scale, offset, dense = packed[layer], high[layer], scale[layer], offset[layer], dense[layer]
    rows, batch = y.shape[1], y.shape[0]
    whole = batch - batch % QDOT_SAMPLES  # the rows of x taken QDOT_SAMPLES at a time
    if kind == Q4_RUNS_OF_16:
        for row in prange(rows):
            for b in range(0, whole, QDOT_SAMPLES):
                q4_rows_dot_runs_of_16(packed, scale, offset, x, row, b, y)
            for b in range(whole, batch):
                q4_row_dot_runs_of_16(packed, scale, offset, x, row, b, y)
    elif kind == Q4_RUNS_OF_32:
        for row in prange(rows):
            for b in range(0, whole, QDOT_SAMPLES):
                q4_rows_dot_runs_of_32(packed, scale, offset, x, row, b, y)
            for b in range(whole, batch):
                q4_row_dot_runs_of_32(packed, scale, offset, x, row, b, y)
    elif kind == Q5:
        for row in prange(rows):
            for b in range(0, whole, QDOT_SAMPLES):
                q5_rows_dot(packed, high, scale, offset, x, row, b, y)
            for b in range(whole, batch):
                q5_row_dot(packed, high, scale, offset, x, row, b, y)
    elif kind == Q8:
        for row in prange(rows):
            for b in range(0, whole, QDOT_SAMPLES):
                q8_rows_dot(packed, scale, x, row, b, y)
            for b in range(whole, batch):
                q8_row_dot(packed, scale, x, row, b, y)
    elif kind == Q4_RUNS_OF_16_X8 or kind == Q8_X8:
        columns = x.shape[1]
        x_values = np.empty((batch, columns), np.int8)
        x_scale = np.empty((batch, columns // 32), np.float32)
        x_total = np.empty((batch, columns // 32), np.int32)
        round_activations_q8(x, x_values, x_scale, x_total)
        by_8 = batch - batch % QDOT_INT8_SAMPLES  # rows of x taken 8, then 4, then 1 at a time
        by_4 = by_8 + (batch - by_8) // 4 * 4
        groups = (rows + QDOT_GROUP_ROWS - 1) // QDOT_GROUP_ROWS
        if kind == Q4_RUNS_OF_16_X8:
            for group in prange(groups):
                for b in range(0, by_8, 8):
                    q4_q8_rows_by_16_x8(packed, scale, offset, x_values, x_scale, x_total, group, b, y)
                for b in range(by_8, by_4, 4):
                    q4_q8_rows_by_16_x4(packed, scale, offset, x_values, x_scale, x_total, group, b, y)
                for b in range(by_4, batch):
                    q4_q8_rows_by_16(packed, scale, offset, x_values, x_scale, x_total, group, b, y)
        else:
            for group in prange(groups):
                for b in range(0, by_8, 8):
                    q8_q8_rows_by_16_x8(packed, scale, x_values, x_scale, x_total, group, b, y)
                for b in range(by_8, by_4, 4):
                    q8_q8_rows_by_16_x4(packed, scale, x_values, x_scale, x_total, group, b, y)
                for b in range(by_4, batch):
                    q8_q8_rows_by_16(packed, scale, x_values, x_scale, x_total, group, b, y)
    elif kind == Q6:
        for row in prange(rows):
            for b in range(0, whole, QDOT_SAMPLES):
                q6_rows_dot(packed, high, scale, x, row, b, y)
            for b in range(whole, batch):
                q6_row_dot(packed, high, scale, x, row, b, y)
    else:
        for row in prange(rows):
            for b in range(batch):
                total = np.float32(0.0)
                for k in range(x.shape[1]):
                    total += dense[row, k] * x[b, k]
                y[b, row] = total


@njit(cache=True)
def add_bias(y, bias):
    for b in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[b, i] += bias[i]


def stack_layers(arrays):
    """A per-layer parameter's views (one per layer) as one C-contiguous (layers, ...) array."""
    return np.ascontiguousarray(np.stack(arrays))
