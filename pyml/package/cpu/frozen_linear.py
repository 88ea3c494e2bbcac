"""A LoRA model's frozen linear map W (y = x Wᵀ) and its input gradient (dX = dY W), on W as a
float matrix or as rows read where the base folder stores them (`StoredRows`: QLoRA).

On stored rows, several rows of x at a time (training, a prompt's prefill): W is dequantized one
tile of rows at a time into a scratch (`TILE_VALUES` values) and each tile is multiplied by BLAS,
so the whole matrix never exists in float. Dequantizing is cheap (4-5 G values/s here); what
costs is BLAS on narrow tiles, which packs x again for each: tiles of 2 MiB made a 1.5B model's
products 10-60% slower than one product of the whole matrix, tiles of 32 MiB 2-11% (2026-12-06,
a 1536 x 8960 and a 17920 x 1536 Q8_0 matrix, 512 rows of x). The tile's values are pyml.weight_formats.dequantize's (in
float32, converted to the model's dtype), so the map is exactly the linear map of the
dequantized matrix (the data the Lean laws' instances name). A few rows (decoding a token) take
the decode step's row products instead (`linear_stored`), which read each stored row once.
"""

import numpy as np
from scipy.linalg.blas import get_blas_funcs

from pyml.package.cpu.linear import product_into
from pyml.package.decode_cpu import dequantize_stored_rows, linear_stored
from pyml.package.kernels_cpu import FEW_ROWS, linear_product
from pyml.package.stored_rows import StoredRows

TILE_VALUES = 1 << 23  # 32 MiB of float32 per tile of dequantized rows
SCRATCH = {}  # the tiles and partial products, one per (use, shape, dtype), made on first use


def scratch(use, shape, dtype):
    key = (use, shape, np.dtype(dtype))
    if key not in SCRATCH:
        SCRATCH[key] = np.empty(shape, dtype)
    return SCRATCH[key]


def tiles(w: StoredRows, dtype, even=False):
    """(first row, tile) over W's rows: tile is W[first : first + len(tile)] dequantized to `dtype`
    (a view of one scratch buffer, overwritten by the next tile); of an even row count but the
    last where `even` (bf16 products take k in pairs)."""
    rows, columns = w.shape
    multiple = 2 if even else 1
    tile_rows = min(rows, max(16, TILE_VALUES // columns // multiple * multiple))
    buffer = scratch("tile", (tile_rows, columns), dtype)
    for first in range(0, rows, tile_rows):
        tile = buffer[: min(tile_rows, rows - first)]
        dequantize_stored_rows(w.weight, w.layer, first, tile)
        yield first, tile


class Bf16Weight:
    """A frozen map W multiplied in bf16 (`pyml train --precision bf16` over a LoRA base): its
    float matrix or StoredRows (`rows`), each product's operands rounded to bfloat16 and the sums
    in float32 (pyml/package/bf16_products.py)."""

    ndim = 2

    def __init__(self, rows):
        self.rows, self.shape, self.dtype = rows, rows.shape, rows.dtype


def frozen_product(x, w, y):
    """y = x @ w.T for x (N, in), w (out, in) frozen, y (N, out): Lean law linear_input_adjoint's
    forward (matVec W v per row of x), W the float matrix or the dequantized stored rows, in bf16
    where w is a Bf16Weight."""
    if isinstance(w, Bf16Weight):
        bf16_frozen_product(x, w.rows, y)
    elif not isinstance(w, StoredRows):
        linear_product(x, w, y)
    elif x.dtype == np.float32 and x.shape[0] < FEW_ROWS and x.flags.c_contiguous and y.flags.c_contiguous:
        linear_stored(w.weight, w.layer, x, y)
    else:
        for first, tile in tiles(w, x.dtype):
            part = scratch("part", (x.shape[0], tile.shape[0]), x.dtype)
            np.matmul(x, tile.T, out=part)
            y[:, first : first + tile.shape[0]] = part


def frozen_input_gradient(dy, w, dx):
    """dx = dy @ w for dy (N, out), w (out, in) frozen, dx (N, in) C-contiguous, overwritten: Lean
    law linear_weight_adjoint_input (dX = G W), W as in frozen_product; over stored rows the sum
    runs tile by tile, each tile's rows' share added in turn."""
    if isinstance(w, Bf16Weight):
        bf16_frozen_input_gradient(dy, w.rows, dx)
        return
    if not isinstance(w, StoredRows):
        np.matmul(dy, w, out=dx)
        return
    if not dx.flags.c_contiguous:  # BLAS adds in place into a contiguous dx only
        whole = scratch("input gradient", dx.shape, dx.dtype)
        frozen_input_gradient(dy, w, whole)
        dx[...] = whole
        return
    gemm = get_blas_funcs("gemm", dtype=dx.dtype)
    for first, tile in tiles(w, dy.dtype):
        rows = dy[:, first : first + tile.shape[0]]
        # dxᵀ = tileᵀ rowsᵀ (+ dxᵀ after the first tile) in BLAS's column-major terms, where the
        # C-ordered dx is dxᵀ: each tile's share is added by the product itself (beta 1), in place,
        # instead of through an (N, in) temporary per tile
        gemm(1.0, tile.T, rows.T, beta=1.0 if first else 0.0, c=dx.T, overwrite_c=True)


def bf16_frozen_product(x, w, y):
    # frozen_product with the operands rounded to bf16: stored rows a dequantized tile at a time
    if not isinstance(w, StoredRows):
        product_into(x, False, w, False, y)
        return
    for first, tile in tiles(w, x.dtype):
        part = scratch("part", (x.shape[0], tile.shape[0]), x.dtype)
        product_into(x, False, tile, False, part)
        y[:, first : first + tile.shape[0]] = part


def bf16_frozen_input_gradient(dy, w, dx):
    # frozen_input_gradient with the operands rounded to bf16: over stored rows, each tile's rows
    # continue the sums where the last tile left them (tiles of an even row count), so the result
    # is the whole product's, bit for bit
    if not isinstance(w, StoredRows):
        product_into(dy, False, w, True, dx)
        return
    for first, tile in tiles(w, dy.dtype, even=True):
        product_into(dy[:, first : first + tile.shape[0]], False, tile, True, dx, add=first > 0)
