"""What every generated fused decode step (gen/<name>/decode_cpu.py) calls besides its package's own
kernels: the linear map of each sequence's row and the embedding, on weight rows read where they
are stored, and the thread count of the pool's next parallel loops (the step wakes the pool for
its matrix-vector products and attention only).

An op's weights arrive as one tuple, the same types for every format, so that one compiled step
serves any mix of formats: (kinds, addresses, layer_kinds, down, up). `kinds` (layers,
rows) uint8 is the kind of each output row and `addresses` (layers, rows) uint64 the absolute
address of its first byte, in a memory map of the model's file (a GGUF, a safetensors file) that
the caller keeps open; the kernels read each row there, in the layout the file stores it
(pyml/formats/quant.py), so no weight is copied. Rows of one layer may differ in kind (a Q4_K_M
file's Q4_K and Q6_K rows, float rows beside quantized ones) and come in any order. `layer_kinds`
(layers,) uint8 is each layer's kind: its rows' one kind, MIXED, or an int8-activation kind
(below); the kernels pick a layer's loop by it once, so that a layer of one kind runs a loop of
that kind's code alone. A model-level weight (the tied LM head) has one layer. `down` and `up`
are a low-rank update the map adds (a LoRA adapter, unmerged: `with_low_rank`), of rank 0 unless
one is given.

    kind              a row's bytes (consecutive blocks)                        value
    ROW_F32, _F16,    little-endian floats                                      as stored
      _BF16
    ROW_F64           little-endian float64 (float64 models: x, y, out float64)  as stored
    ROW_Q8_0          34 per 32 values: f16 d, 32 int8 q                        q * d
    ROW_Q4_0          18 per 32: f16 d, 16 bytes of nibbles                     (q - 8) * d
    ROW_Q4_1          20 per 32: f16 d, f16 m, 16 bytes of nibbles              q * d + m
    ROW_Q5_0          22 per 32: f16 d, 4 bytes of fifth bits, 16 of nibbles    (q - 16) * d
    ROW_Q4_K          144 per 256: f16 d, f16 dmin, 12 bytes of 6-bit scales    (d sc) q - dmin min
                      and mins, 128 bytes of nibbles
    ROW_Q5_K          176 per 256: as ROW_Q4_K, with 32 bytes of fifth bits      (d sc) q - dmin min
                      before the nibbles
    ROW_Q6_K          210 per 256: 128 bytes of low nibbles, 64 of 2-bit        (d sc) (q - 32)
                      highs, 16 int8 scales, f16 d

A layer whose rows are all ROW_Q8_0, all ROW_Q4_0 or all ROW_Q4_1 may instead have the layer kind
Q8_0_X8, Q4_0_X8 or Q4_1_X8 (`pyml generate --activations q8_0`,
pyml.generate.stored_step.with_int8_activations): its linear map rounds the op's input to int8
first (quantized_dot.round_activations_q8) and multiplies it with integer block products, 16 rows
at a time, the rows still read where they are stored (quantized_dot.py's section "int8
activations" says how and why). Each dot product is pyml/package/quantized_dot.py's, so a linear
map is the same function here as the exact model's (Lean law linear_input_adjoint's forward,
matVec W v, W the block dequantization of the stored values).

Numba's cache does not notice when a function a cached kernel calls changes in another file, so the
generated decode modules carry this module's and quantized_dot's hash in their first line (as for
vector_math), and this module's own cached kernels, which call quantized_dot's intrinsics, are
stamped with a digest of the whole package (pyml/package/numba_cache.py). `linear_stored` compiles
in about 17 s here: cached, a process that compiles a new model's step links it instead.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from pyml.formats.quant import GGMLType
from pyml.package.quantized_dot import (
    INT8_Q4_0,
    INT8_Q4_1,
    INT8_Q8_0,
    QDOT_GROUP_ROWS,
    QDOT_INT8_SAMPLES,
    int8_rows_by_16,
    round_activations_q8,
    stored_bf16_values,
    stored_f16_values,
    stored_f32_values,
    stored_float64,
    stored_q4_0_values,
    stored_q4_1_values,
    stored_q4_k_values,
    stored_q5_k_values,
    stored_q5_0_values,
    stored_q6_k_values,
    stored_q8_0_values,
    stored_row_products as stored_row_products_of,
    stored_row_values,
)

FAST = {"contract", "reassoc"}

# the kind of each row (uint8 in a weight's `kinds`)
ROW_Q8_0, ROW_Q4_0, ROW_Q4_1, ROW_Q5_0, ROW_Q4_K, ROW_Q6_K, ROW_F32, ROW_F16, ROW_BF16, ROW_F64 = range(8, 18)
ROW_Q5_K = 18
ROW_KIND_OF = {GGMLType.F32: ROW_F32, GGMLType.F16: ROW_F16, GGMLType.BF16: ROW_BF16,
               GGMLType.F64: ROW_F64, GGMLType.Q8_0: ROW_Q8_0, GGMLType.Q4_0: ROW_Q4_0,
               GGMLType.Q4_1: ROW_Q4_1, GGMLType.Q5_0: ROW_Q5_0, GGMLType.Q4_K: ROW_Q4_K,
               GGMLType.Q5_K: ROW_Q5_K, GGMLType.Q6_K: ROW_Q6_K}
# the layout of every kind read by quantized_dot's row loops in float32 (ROW_F64 is read by
# `stored_float64`, the int8 kinds from their repacked arrays)
STORED_ROW_LOOPS = {ROW_F32: stored_f32_values, ROW_F16: stored_f16_values, ROW_BF16: stored_bf16_values,
                    ROW_Q8_0: stored_q8_0_values, ROW_Q4_0: stored_q4_0_values,
                    ROW_Q4_1: stored_q4_1_values, ROW_Q5_0: stored_q5_0_values,
                    ROW_Q4_K: stored_q4_k_values, ROW_Q5_K: stored_q5_k_values,
                    ROW_Q6_K: stored_q6_k_values}
# a layer's kind (`layer_kinds`) where its rows are not all of one kind
MIXED = 255
# a layer's kind where its rows, all ROW_Q8_0, all ROW_Q4_0 or all ROW_Q4_1, multiply int8-rounded
# activations (`pyml generate --activations q8_0`): the rows read where they are stored, as ever
Q8_0_X8, Q4_0_X8, Q4_1_X8 = 5, 6, 7
INT8_LAYER_KIND_OF = {ROW_Q8_0: Q8_0_X8, ROW_Q4_0: Q4_0_X8, ROW_Q4_1: Q4_1_X8}
stored_row_products = stored_row_products_of(STORED_ROW_LOOPS)
stored_row_dequantized = stored_row_values(STORED_ROW_LOOPS)
rows_by_16 = int8_rows_by_16({Q8_0_X8: INT8_Q8_0, Q4_0_X8: INT8_Q4_0, Q4_1_X8: INT8_Q4_1})

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


@njit(cache=True, parallel=True, fastmath=FAST)
def linear_stored(weight, layer, x, y):
    """y[b] = W x[b] for each row b, W layer `layer` of `weight` in the stored form (kinds,
    addresses, layer_kinds; the module's docstring); x is (B, in), y (B, out), float32 (ROW_F64
    rows: float64), C-contiguous. One output row per iteration of the parallel loop, read from
    memory once per step and decoded once per QDOT_SAMPLES sequences, each y[b, row] summed in the
    same order whatever the batch. The layer's kind picks the loop once: each kind has a parallel
    loop of its own that runs only its code (a MIXED layer's loop picks each row's). The
    int8-activation kinds round every row of x on the calling thread, then take 16 output rows per
    iteration, their blocks put rows by 16 once per 8 sequences (then 4, then 1), each sequence's
    sums its own likewise. No BLAS, so no BLAS thread wakes up."""
    kinds, addresses, layer_kinds = weight[0], weight[1], weight[2]
    kind, row_kinds, row_addresses = layer_kinds[layer], kinds[layer], addresses[layer]
    rows, batch = y.shape[1], y.shape[0]
    if kind == Q8_0_X8 or kind == Q4_0_X8 or kind == Q4_1_X8:
        columns = x.shape[1]
        x_values = np.empty((batch, columns), np.int8)
        x_scale = np.empty((batch, columns // 32), np.float32)
        x_total = np.empty((batch, columns // 32), np.int32)
        round_activations_q8(x, x_values, x_scale, x_total)
        by_8 = batch - batch % QDOT_INT8_SAMPLES  # rows of x taken 8, then 4, then 1 at a time
        by_4 = by_8 + (batch - by_8) // 4 * 4
        groups = (rows + QDOT_GROUP_ROWS - 1) // QDOT_GROUP_ROWS
        # the kind is a literal in each call below: each loop holds that layout's code alone
        if kind == Q8_0_X8:
            for group in prange(groups):
                for b in range(0, by_8, 8):
                    rows_by_16(Q8_0_X8, 8, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_8, by_4, 4):
                    rows_by_16(Q8_0_X8, 4, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_4, batch):
                    rows_by_16(Q8_0_X8, 1, row_addresses, x_values, x_scale, x_total, group, b, y)
        elif kind == Q4_0_X8:
            for group in prange(groups):
                for b in range(0, by_8, 8):
                    rows_by_16(Q4_0_X8, 8, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_8, by_4, 4):
                    rows_by_16(Q4_0_X8, 4, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_4, batch):
                    rows_by_16(Q4_0_X8, 1, row_addresses, x_values, x_scale, x_total, group, b, y)
        else:
            for group in prange(groups):
                for b in range(0, by_8, 8):
                    rows_by_16(Q4_1_X8, 8, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_8, by_4, 4):
                    rows_by_16(Q4_1_X8, 4, row_addresses, x_values, x_scale, x_total, group, b, y)
                for b in range(by_4, batch):
                    rows_by_16(Q4_1_X8, 1, row_addresses, x_values, x_scale, x_total, group, b, y)
    # the kind is a constant in each call below: each loop holds that kind's code alone
    elif kind == ROW_Q8_0:
        for row in prange(rows):
            stored_row_products(ROW_Q8_0, row_addresses[row], x, row, y)
    elif kind == ROW_Q4_0:
        for row in prange(rows):
            stored_row_products(ROW_Q4_0, row_addresses[row], x, row, y)
    elif kind == ROW_Q4_1:
        for row in prange(rows):
            stored_row_products(ROW_Q4_1, row_addresses[row], x, row, y)
    elif kind == ROW_Q5_0:
        for row in prange(rows):
            stored_row_products(ROW_Q5_0, row_addresses[row], x, row, y)
    elif kind == ROW_Q4_K:
        for row in prange(rows):
            stored_row_products(ROW_Q4_K, row_addresses[row], x, row, y)
    elif kind == ROW_Q5_K:
        for row in prange(rows):
            stored_row_products(ROW_Q5_K, row_addresses[row], x, row, y)
    elif kind == ROW_Q6_K:
        for row in prange(rows):
            stored_row_products(ROW_Q6_K, row_addresses[row], x, row, y)
    elif kind == ROW_F32:
        for row in prange(rows):
            stored_row_products(ROW_F32, row_addresses[row], x, row, y)
    elif kind == ROW_F16:
        for row in prange(rows):
            stored_row_products(ROW_F16, row_addresses[row], x, row, y)
    elif kind == ROW_BF16:
        for row in prange(rows):
            stored_row_products(ROW_BF16, row_addresses[row], x, row, y)
    elif kind == ROW_F64:
        for row in prange(rows):
            float64_row_products(row_addresses[row], x, row, y)
    else:
        for row in prange(rows):
            if row_kinds[row] == ROW_F64:
                float64_row_products(row_addresses[row], x, row, y)
            else:
                stored_row_products(row_kinds[row], row_addresses[row], x, row, y)
    low_rank_add(weight[3], weight[4], layer, x, y)


@njit(cache=True, parallel=True)
def low_rank_add(down, up, layer, x, y):
    """y[b] += up[layer] (down[layer] x[b]) for each row b: a LoRA adapter's update of the linear
    map, its B (times alpha / r) as `up` (layers, rows, R) and its A as `down` (layers, R, in),
    the adapters of several row blocks stacked along R (zeros in `up` outside each block's rows),
    applied beside the stored rows as llama.cpp applies a LoRA adapter, not folded into them. R = 0
    (no adapter) adds nothing. Each y[b, row] gets its sums in a fixed order, whatever the batch."""
    rank = down.shape[1]
    if rank == 0:
        return
    hidden = np.zeros((x.shape[0], rank), x.dtype)  # down x[b], R values per row of x
    for b in range(x.shape[0]):
        for r in range(rank):
            total = 0.0
            for k in range(x.shape[1]):
                total += down[layer, r, k] * x[b, k]
            hidden[b, r] = total
    for row in prange(y.shape[1]):
        for b in range(y.shape[0]):
            total = 0.0
            for r in range(rank):
                total += up[layer, row, r] * hidden[b, r]
            y[b, row] += total


@njit(cache=True, fastmath=FAST)
def float64_row_products(address, x, row, y):
    """y[b, row] = the ROW_F64 row at `address` times x[b], for every row b (scalar code: only the
    float64 models of the exact tests have such rows)."""
    for b in range(x.shape[0]):
        total = 0.0
        for k in range(x.shape[1]):
            total += stored_float64(address, k) * x[b, k]
        y[b, row] = total


@njit(cache=True, parallel=True)
def embedding_stored(weight, ids, out, scale):
    """out[n] = row ids[n] of layer 0 of `weight` (the stored form), dequantized, times `scale`:
    ids (N,) int64, out (N, dim) C-contiguous, float32 or float64 (ROW_F64 rows: float64), scale in
    out's dtype. A quantized or float row's values are pyml.formats.quant.dequantize's float32 bits,
    converted to out's dtype, then multiplied by `scale` in that dtype (as embedding_forward_kernel
    multiplies a float32 table's rows), so a scale of 1 leaves them as they are. One row per
    token: the row's kind is looked up per row (a table read one row per token gains nothing from
    a loop of its own per kind)."""
    kinds, addresses = weight[0][0], weight[1][0]
    for n in range(ids.shape[0]):
        if ids[n] < 0 or ids[n] >= kinds.shape[0]:
            raise ValueError("token id out of range of the embedding table")
    for n in prange(ids.shape[0]):
        kind, address = kinds[ids[n]], addresses[ids[n]]
        if kind == ROW_F64:
            for d in range(out.shape[1]):
                out[n, d] = stored_float64(address, d) * scale
        else:
            stored_row_dequantized(kind, address, out, n)
            for d in range(out.shape[1]):
                out[n, d] *= scale


@njit(cache=True, parallel=True)
def dequantize_stored_rows(weight, layer, first, tile):
    """tile[r] = row first + r of layer `layer` of `weight` (the stored form), dequantized as
    `embedding_stored` dequantizes a row (pyml.formats.quant.dequantize's float32 bits, converted
    to tile's dtype; ROW_F64 rows as stored): tile (rows, columns) C-contiguous, float32 or
    float64. A LoRA model's frozen linear maps multiply such tiles by BLAS (QLoRA:
    pyml/package/cpu/frozen_linear.py), so the whole matrix is never dequantized at once. One
    parallel loop per layer kind, as in linear_stored."""
    kinds, addresses, layer_kinds = weight[0], weight[1], weight[2]
    kind, row_kinds, row_addresses = layer_kinds[layer], kinds[layer], addresses[layer]
    if first < 0 or first + tile.shape[0] > row_kinds.shape[0]:
        raise ValueError("the tile's rows lie outside the weight")
    # the kind is a constant in each call below: each loop holds that kind's code alone
    if kind == ROW_Q8_0:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q8_0, row_addresses[first + r], tile, r)
    elif kind == ROW_Q4_0:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q4_0, row_addresses[first + r], tile, r)
    elif kind == ROW_Q4_1:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q4_1, row_addresses[first + r], tile, r)
    elif kind == ROW_Q5_0:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q5_0, row_addresses[first + r], tile, r)
    elif kind == ROW_Q4_K:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q4_K, row_addresses[first + r], tile, r)
    elif kind == ROW_Q5_K:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q5_K, row_addresses[first + r], tile, r)
    elif kind == ROW_Q6_K:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_Q6_K, row_addresses[first + r], tile, r)
    elif kind == ROW_F32:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_F32, row_addresses[first + r], tile, r)
    elif kind == ROW_F16:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_F16, row_addresses[first + r], tile, r)
    elif kind == ROW_BF16:
        for r in prange(tile.shape[0]):
            stored_row_dequantized(ROW_BF16, row_addresses[first + r], tile, r)
    else:
        for r in prange(tile.shape[0]):
            if row_kinds[first + r] == ROW_F64:
                for d in range(tile.shape[1]):
                    tile[r, d] = stored_float64(row_addresses[first + r], d)
            else:
                stored_row_dequantized(row_kinds[first + r], row_addresses[first + r], tile, r)


def layer_kinds_of(kinds: np.ndarray) -> np.ndarray:
    """The kind of each layer of `kinds` (layers, rows): its rows' one kind, or MIXED."""
    uniform = np.all(kinds == kinds[:, :1], axis=1)
    return np.where(uniform, kinds[:, 0], MIXED).astype(np.uint8)


def stored_weight(kinds: np.ndarray, addresses: np.ndarray) -> tuple:
    """The stored form (kinds, addresses, layer_kinds, down, up) of an op on float activations:
    kinds (layers, rows) of ROW_* kinds, addresses (layers, rows) of each row's first byte
    (`row_addresses`), and no low-rank update (`with_low_rank` adds one). The kernels read
    the rows through the addresses alone: the caller keeps the arrays (memory maps) holding them
    alive, and their rows whole (each row's bytes its kind's whole blocks of x.shape[1] values),
    while it runs them."""
    kinds, addresses = np.ascontiguousarray(kinds, np.uint8), np.ascontiguousarray(addresses, np.uint64)
    if kinds.ndim != 2 or kinds.shape != addresses.shape or not kinds.shape[1]:
        raise ValueError(f"kinds {kinds.shape} and addresses {addresses.shape} must be one (layers, rows) "
                         "shape, with rows")
    unknown = np.setdiff1d(kinds, list(STORED_ROW_LOOPS) + [ROW_F64])
    if unknown.size:
        raise ValueError(f"row kinds {unknown.tolist()} are not read where they are stored")
    layers, rows = kinds.shape
    return (kinds, addresses, layer_kinds_of(kinds), np.zeros((layers, 0, 0), np.float32),
            np.zeros((layers, rows, 0), np.float32))


def with_low_rank(weight: tuple, down: np.ndarray, up: np.ndarray) -> tuple:
    """`weight` (the stored form) whose map adds up[l] (down[l] x) to each row's product
    (`low_rank_add`): a LoRA adapter kept beside the stored rows. down (layers, R, in) and up
    (layers, rows, R), float32, of the weight's layers and rows."""
    kinds = weight[0]
    down, up = np.ascontiguousarray(down, np.float32), np.ascontiguousarray(up, np.float32)
    if down.ndim != 3 or up.shape != (*kinds.shape, down.shape[1]) or down.shape[0] != kinds.shape[0]:
        raise ValueError(f"a low-rank update of {kinds.shape} needs down (layers, R, in) and up "
                         f"(layers, rows, R), not {down.shape} and {up.shape}")
    return (*weight[:3], down, up)


def row_addresses(data: np.ndarray, rows: int) -> np.ndarray:
    """The address of each of the `rows` rows of a tensor's bytes `data` (a C-contiguous array, a
    view of a memory map: its rows of equal size one after another), uint64 (rows,). The caller
    keeps `data` alive while the addresses are used: they hold no reference to it."""
    if not data.flags.c_contiguous or data.nbytes % rows:
        raise ValueError(f"{data.nbytes} bytes, {'' if data.flags.c_contiguous else 'not contiguous, '}"
                         f"are not {rows} rows of equal size")
    return np.uint64(data.ctypes.data) + np.arange(rows, dtype=np.uint64) * np.uint64(data.nbytes // rows)


@njit(cache=True)
def add_bias(y, bias):
    for b in range(y.shape[0]):
        for i in range(y.shape[1]):
            y[b, i] += bias[i]


def stack_layers(arrays):
    """A per-layer parameter's views (one per layer) as one C-contiguous (layers, ...) array."""
    return np.ascontiguousarray(np.stack(arrays))
