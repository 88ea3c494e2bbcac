"""What every generated fused decode step (gen/<name>/decode_cpu.py) calls besides its package's own
kernels: the linear map of each sequence's row and the embedding, on weight rows read where they
are stored, and the thread count of the pool's next parallel loops (the step wakes the pool for
its matrix-vector products and attention only).

An op's weights arrive as one tuple, the same types for every format, so that one compiled step
serves any mix of formats: (kinds, addresses, layer_kinds, down, up). `kinds` (layers, rows) uint8
is the kind of each output row, its format's GGML type id, and `addresses` (layers, rows) uint64
the absolute address of its first byte, in a memory map of the model's file (a GGUF, a safetensors
file) that the caller keeps open; the kernels read each row there, in the layout the file stores
it (its format's module in pyml/weight_formats says which), so no weight is copied. Rows of one
layer may differ in kind (a Q4_K_M file's Q4_K and Q6_K rows, float rows beside quantized ones)
and come in any order. `layer_kinds` (layers,) uint8 is each layer's kind: its rows' one kind,
MIXED, or an int8-activation kind (below); a layer of one kind runs a parallel loop over parts of
ROWS_PER_PART rows, each part's rows decoded by a loop of that kind's code alone. A model-level
weight (the tied LM head) has one layer. `down` and `up` are a low-rank update the map adds (a
LoRA adapter, unmerged: `with_low_rank`), of rank 0 unless one is given.

The kinds read in place are the formats with a row loop (`WeightFormat.row_values`: F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K), and ROW_F64, little-endian float64 rows (the
float64 models of the exact tests: x, y, out float64).

A layer whose rows are all of one format with an int8 layout (Q8_0, Q4_0, Q4_1) may instead have
the layer kind INT8_LAYER | its type id (`pyml generate --activations q8_0`,
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

from pyml.package.quantized_dot import (
    QDOT_GROUP_ROWS,
    QDOT_INT8_SAMPLES,
    int8_rows_by_16,
    round_activations_q8,
    stored_float64,
    stored_rows_products as stored_rows_products_of,
    stored_rows_values,
)
from pyml.weight_formats import FORMATS, GGMLType

FAST = {"contract", "reassoc"}

# a row's kind (uint8 in a weight's `kinds`) is its format's GGML type id; ROW_F64, the float64
# rows of the exact tests' models, is read by `stored_float64`, the others by their format's loop
ROW_F64 = int(GGMLType.F64)
ROW_KINDS = {int(ggml_type): format.row_values for ggml_type, format in FORMATS.items()
             if format.row_values is not None}
# every row kind the kernels read where it is stored
READ_IN_PLACE = frozenset(ROW_KINDS) | {ROW_F64}
# a layer's kind (`layer_kinds`) where its rows are not all of one kind
MIXED = 255
# a layer's kind where its rows, all of one format with an int8 layout, multiply int8-rounded
# activations (`pyml generate --activations q8_0`): the rows read where they are stored, as ever
INT8_LAYER = 0x80
INT8_LAYER_KIND_OF = {int(ggml_type): INT8_LAYER | int(ggml_type) for ggml_type, format in FORMATS.items()
                      if format.int8 is not None}
# the rows of a parallel loop's iteration over one kind's rows (the kind's switch taken once per part)
ROWS_PER_PART = 16
stored_rows_products = stored_rows_products_of(ROW_KINDS)
stored_rows_dequantized = stored_rows_values(ROW_KINDS)
rows_by_16 = int8_rows_by_16({INT8_LAYER_KIND_OF[int(ggml_type)]: format for ggml_type, format in FORMATS.items()
                              if format.int8 is not None})

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
    rows: float64), C-contiguous. ROWS_PER_PART output rows per iteration of the parallel loop,
    each row read from memory once per step and decoded once per QDOT_SAMPLES sequences, each
    y[b, row] summed in the same order whatever the batch. A layer of one kind has each part's rows
    decoded by that kind's loop alone (a MIXED layer's loop picks each row's). The
    int8-activation kinds round every row of x on the calling thread, then take 16 output rows per
    iteration, their blocks put rows by 16 once per 8 sequences (then 4, then 1), each sequence's
    sums its own likewise. No BLAS, so no BLAS thread wakes up."""
    kinds, addresses, layer_kinds = weight[0], weight[1], weight[2]
    kind, row_kinds, row_addresses = layer_kinds[layer], kinds[layer], addresses[layer]
    rows, batch = y.shape[1], y.shape[0]
    if kind != MIXED and kind & INT8_LAYER:
        columns = x.shape[1]
        x_values = np.empty((batch, columns), np.int8)
        x_scale = np.empty((batch, columns // 32), np.float32)
        x_total = np.empty((batch, columns // 32), np.int32)
        round_activations_q8(x, x_values, x_scale, x_total)
        by_8 = batch - batch % QDOT_INT8_SAMPLES  # rows of x taken 8, then 4, then 1 at a time
        by_4 = by_8 + (batch - by_8) // 4 * 4
        groups = (rows + QDOT_GROUP_ROWS - 1) // QDOT_GROUP_ROWS
        for group in prange(groups):
            for b in range(0, by_8, 8):
                rows_by_16(kind, 8, row_addresses, x_values, x_scale, x_total, group, b, y)
            for b in range(by_8, by_4, 4):
                rows_by_16(kind, 4, row_addresses, x_values, x_scale, x_total, group, b, y)
            for b in range(by_4, batch):
                rows_by_16(kind, 1, row_addresses, x_values, x_scale, x_total, group, b, y)
    elif kind == ROW_F64:
        for row in prange(rows):
            float64_row_products(row_addresses[row], x, row, y)
    elif kind == MIXED:
        for row in prange(rows):
            if row_kinds[row] == ROW_F64:
                float64_row_products(row_addresses[row], x, row, y)
            else:
                stored_rows_products(row_kinds[row], row_addresses, x, row, row + 1, y)
    else:
        for part in prange((rows + ROWS_PER_PART - 1) // ROWS_PER_PART):
            first = part * ROWS_PER_PART
            stored_rows_products(kind, row_addresses, x, first, min(first + ROWS_PER_PART, rows), y)
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
    out's dtype. A quantized or float row's values are its format's numpy dequantizer's float32 bits,
    converted to out's dtype, then multiplied by `scale` in that dtype (as embedding_forward_kernel
    multiplies a float32 table's rows), so a scale of 1 leaves them as they are. One row per
    token: the row's kind is looked up per row (a table read one row per token gains nothing from
    a loop of its own per kind)."""
    kinds, addresses = weight[0][0], weight[1][0]
    for n in range(ids.shape[0]):
        if ids[n] < 0 or ids[n] >= kinds.shape[0]:
            raise ValueError("token id out of range of the embedding table")
    for n in prange(ids.shape[0]):
        row = ids[n]
        if kinds[row] == ROW_F64:
            for d in range(out.shape[1]):
                out[n, d] = stored_float64(addresses[row], d) * scale
        else:
            stored_rows_dequantized(kinds[row], addresses, row, row + 1, out, n)
            for d in range(out.shape[1]):
                out[n, d] *= scale


@njit(cache=True, parallel=True)
def dequantize_stored_rows(weight, layer, first, tile):
    """tile[r] = row first + r of layer `layer` of `weight` (the stored form), dequantized as
    `embedding_stored` dequantizes a row (its format's numpy dequantizer's float32 bits, converted
    to tile's dtype; ROW_F64 rows as stored): tile (rows, columns) C-contiguous, float32 or
    float64. A LoRA model's frozen linear maps multiply such tiles by BLAS (QLoRA:
    pyml/package/cpu/frozen_linear.py), so the whole matrix is never dequantized at once. A layer
    of one kind by parts of ROWS_PER_PART rows, as in linear_stored."""
    kinds, addresses, layer_kinds = weight[0], weight[1], weight[2]
    kind, row_kinds, row_addresses = layer_kinds[layer], kinds[layer], addresses[layer]
    if first < 0 or first + tile.shape[0] > row_kinds.shape[0]:
        raise ValueError("the tile's rows lie outside the weight")
    if kind == MIXED or kind == ROW_F64:
        for r in prange(tile.shape[0]):
            if row_kinds[first + r] == ROW_F64:
                for d in range(tile.shape[1]):
                    tile[r, d] = stored_float64(row_addresses[first + r], d)
            else:
                stored_rows_dequantized(row_kinds[first + r], row_addresses, first + r, first + r + 1, tile, r)
    else:
        for part in prange((tile.shape[0] + ROWS_PER_PART - 1) // ROWS_PER_PART):
            start = part * ROWS_PER_PART
            stop = min(start + ROWS_PER_PART, tile.shape[0])
            stored_rows_dequantized(kind, row_addresses, first + start, first + stop, tile, start)


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
    unknown = np.setdiff1d(kinds, list(ROW_KINDS) + [ROW_F64])
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
