"""Matrix products with bfloat16 operands and float32 sums, on AVX-512 BF16's `vdpbf16ps`
(`pyml train --precision bf16`; issue 45's route, measured in bench/bf16_products.py).

C (M, N) = A (M, K) B (K, N), where every value of A and B is first rounded from float32 to the
nearest bfloat16 (ties to even; a NaN stays a NaN) and the products are summed in float32: what
torch's CPU autocast does to a linear layer's operands. The operands stay float32 arrays (the
master weights, the activations); the rounding happens as they are packed.

How:
- Numba cannot name `vdpbf16ps`, so `product_tile` writes the inner loop in LLVM IR with the
  intrinsic `llvm.x86.avx512bf16.dpbf16ps.512` (as quantized_dot.py writes VNNI's `vpdpbusd`):
  one tile of 8 rows x 32 columns of C in sixteen vectors of 16 float32 sums; per pair of k, two
  loads of B, eight broadcasts of A's pairs and sixteen `vdpbf16ps`.
- `bf16_product` packs A in panels of 8 rows and B in panels of 32 columns, each as uint32 pairs
  of bf16 (k, k + 1), k-major, the lower k in the low half (the instruction's order), zeros past
  the ends: A once, in parallel; B a block of k at a time, its panels in parallel. The tiles of a
  block go by chunks of A's row panels, the panels of B in parallel within a chunk, so that a
  chunk of A and a panel of B stay in cache (GotoBLAS's blocking; without it a long k, as the LM
  head's input gradient's 49,152, streamed A from memory once per panel of B).
- The instruction adds each pair's two exact products (a bf16 product fits float32) to the sum in
  turn, rounding to nearest even after each add, with denormal inputs and results flushed to zero
  (Intel's definition of VDPBF16PS): so on values whose products and partial sums float32 holds
  exactly, C equals the exact product of the rounded operands (tests/proofs/test_conformance.py,
  against pyml/exact.py's `round_bf16`).

A CPU without AVX512_BF16 cannot run these (`has_bf16_products`); `pyml train --precision bf16`
refuses there.
"""

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

MR, NR = 8, 32  # a tile: rows of A, columns of B (two vectors of 16 float32 lanes)
# pairs of k per block: each panel's block of B (BLOCK_PAIRS x NR pairs, 32 KiB) stays in L1
# while a chunk of A's row panels passes it; a block's sums continue the last block's
# (product_tile_add)
BLOCK_PAIRS = 256
# row panels of A per chunk: a chunk's block (ROW_PANELS x BLOCK_PAIRS x MR pairs, 512 KiB) stays
# in L2 while every panel of B passes it, rather than all of A's block streaming from memory once
# per panel of B (the LM head's weight gradient at 4 x 512 tokens: 48 MiB a block, 18 panels)
ROW_PANELS = 64
ACROSS_PANELS = 64  # panels of A packed together when A is read across (512 of its columns)


def has_bf16_products() -> bool:
    """Whether this CPU has AVX-512 BF16 (`vdpbf16ps`), as LLVM reads the host's features."""
    return binding.get_host_cpu_features().get("avx512bf16", False)


class BFloatType(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder does not name."""

    def _to_string(self):
        return "bfloat"


I32, F32 = ir.IntType(32), ir.FloatType()
PAIRS_VECTOR, LANES, BF16_LANES = ir.VectorType(I32, 16), ir.VectorType(F32, 16), ir.VectorType(BFloatType(), 32)


def tile_codegen(context, builder, signature, args, accumulate):
    a, a_at, b, b_at, pairs, c, c_at, c_stride = args
    a_type, _, b_type, _, _, c_type, _, _ = signature.args
    a_data = builder.gep(context.make_array(a_type)(context, builder, a).data, [a_at])
    b_data = builder.gep(context.make_array(b_type)(context, builder, b).data, [b_at])
    c_data = builder.gep(context.make_array(c_type)(context, builder, c).data, [c_at])
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(LANES, [LANES, BF16_LANES, BF16_LANES]),
                                         "llvm.x86.avx512bf16.dpbf16ps.512")
    def start(m, j):  # the tile's sums start at zero, or at what c holds (accumulate)
        if not accumulate:
            return ir.Constant(LANES, [0.0] * 16)
        row = builder.gep(c_data, [builder.mul(ir.Constant(c_stride.type, m), c_stride)])
        return builder.load(builder.bitcast(builder.gep(row, [ir.Constant(c_stride.type, 16 * j)]),
                                            LANES.as_pointer()), align=4)

    sums = [[cgutils.alloca_once_value(builder, start(m, j)) for j in range(NR // 16)] for m in range(MR)]
    undefined, first_lane = ir.Constant(PAIRS_VECTOR, ir.Undefined), ir.Constant(PAIRS_VECTOR, [0] * 16)
    with cgutils.for_range(builder, pairs) as loop:
        k = loop.index
        b_row = builder.gep(b_data, [builder.mul(k, ir.Constant(k.type, NR))])
        columns = [builder.bitcast(builder.load(builder.bitcast(builder.gep(b_row, [ir.Constant(k.type, 16 * j)]),
                                                               PAIRS_VECTOR.as_pointer()), align=4), BF16_LANES)
                   for j in range(NR // 16)]
        a_row = builder.gep(a_data, [builder.mul(k, ir.Constant(k.type, MR))])
        for m in range(MR):
            pair = builder.load(builder.gep(a_row, [ir.Constant(k.type, m)]))
            splat = builder.shuffle_vector(builder.insert_element(undefined, pair, ir.Constant(I32, 0)),
                                           undefined, first_lane)
            for j, column in enumerate(columns):
                total = builder.call(dot, [builder.load(sums[m][j]), builder.bitcast(splat, BF16_LANES), column])
                builder.store(total, sums[m][j])
    for m in range(MR):
        row = builder.gep(c_data, [builder.mul(ir.Constant(c_stride.type, m), c_stride)])
        for j in range(NR // 16):
            at = builder.gep(row, [ir.Constant(c_stride.type, 16 * j)])
            builder.store(builder.load(sums[m][j]), builder.bitcast(at, LANES.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def product_tile(typingctx, a, a_at, b, b_at, pairs, c, c_at, c_stride):
    """The MR x NR block of A B over `pairs` pairs of k, written to c[c_at + i * c_stride + j]:
    a[a_at:] holds A's pairs k-major (MR per pair), b[b_at:] B's (NR per pair); each uint32 two
    bf16 values, the lower k in the low half."""
    return types.none(a, a_at, b, b_at, pairs, c, c_at, c_stride), lambda *args: tile_codegen(*args, False)


@intrinsic
def product_tile_add(typingctx, a, a_at, b, b_at, pairs, c, c_at, c_stride):
    """product_tile, its sums continuing from what the block of c holds: a product split along k
    into parts, each added in turn, sums as the whole product does, bit for bit."""
    return types.none(a, a_at, b, b_at, pairs, c, c_at, c_stride), lambda *args: tile_codegen(*args, True)


@njit(inline="always")
def bf16_bits(bits):
    # the bf16 nearest (ties to even) to the float32 of these bits, as 16 bits; a NaN stays NaN.
    # No branch: the packing loops vectorize
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
    return quiet if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000) else rounded


@njit(inline="always")
def pair_at(bits, line, k, across):
    # the pair (k, k + 1) of `line` (zeros past the end): along row `line` of bits, or, across,
    # down its column `line`
    depth = bits.shape[0] if across else bits.shape[1]
    if across:
        low = bits[k, line] if k < depth else np.uint32(0)
        high = bits[k + 1, line] if k + 1 < depth else np.uint32(0)
    else:
        low = bits[line, k] if k < depth else np.uint32(0)
        high = bits[line, k + 1] if k + 1 < depth else np.uint32(0)
    return bf16_bits(low) | (bf16_bits(high) << np.uint32(16))


@njit(cache=True)
def pack_panel(bits, panel, width, lines, across, first, out):
    # out[kp * width + i] = the pair (first + 2 kp, first + 2 kp + 1) of line panel * width + i,
    # zeros past the last line and k. The pairs whose two k exist are packed through slices, in
    # loops LLVM vectorizes (3-4x faster than indexing bits itself, measured on a 3072 x 576
    # weight); the rest, a last odd k and missing lines, one at a time
    pairs = out.shape[0] // width
    depth = bits.shape[0] if across else bits.shape[1]
    start = panel * width
    present = max(0, min(width, lines - start))  # the panel's lines that exist
    whole = max(0, min(pairs, (depth - first) // 2))  # its pairs of two existing k
    if across:
        for kp in range(whole):
            low = bits[first + 2 * kp, start : start + present]
            high = bits[first + 2 * kp + 1, start : start + present]
            row = out[kp * width : kp * width + present]
            for i in range(present):
                row[i] = bf16_bits(low[i]) | (bf16_bits(high[i]) << np.uint32(16))
    else:
        for i in range(present):
            line = bits[start + i, first : first + 2 * whole]
            for kp in range(whole):
                out[kp * width + i] = bf16_bits(line[2 * kp]) | (bf16_bits(line[2 * kp + 1]) << np.uint32(16))
    pack_edges(bits, panel, width, lines, across, first, out)


@njit(cache=True)
def pack_edges(bits, panel, width, lines, across, first, out):
    # the entries of pack_panel's `out` that its fast loops leave: a last odd k, missing lines
    pairs = out.shape[0] // width
    depth = bits.shape[0] if across else bits.shape[1]
    present = max(0, min(width, lines - panel * width))
    whole = max(0, min(pairs, (depth - first) // 2))
    for kp in range(pairs):
        for i in range(width):
            if i >= present:
                out[kp * width + i] = np.uint32(0)
            elif kp >= whole:
                out[kp * width + i] = pair_at(bits, panel * width + i, first + 2 * kp, across)


@njit(cache=True)
def pack_panels_across(bits, first_panel, panels, width, lines, pairs, out):
    # pack_panel(across, first 0) of `panels` consecutive panels into out (each pairs * width
    # long), reading each pair of bits' rows along the panels' whole stretch of columns: one panel
    # at a time, a long k (a weight gradient's tokens) reads a row of the LM head's gradient 32
    # bytes at a time, a page apart, and the packing took as long as the product
    whole = min(pairs, bits.shape[0] // 2)
    for kp in range(whole):
        for panel in range(first_panel, first_panel + panels):
            start = panel * width
            present = max(0, min(width, lines - start))
            low, high = bits[2 * kp, start : start + present], bits[2 * kp + 1, start : start + present]
            row = out[panel * pairs * width + kp * width : panel * pairs * width + kp * width + present]
            for i in range(present):
                row[i] = bf16_bits(low[i]) | (bf16_bits(high[i]) << np.uint32(16))
    for panel in range(first_panel, first_panel + panels):
        pack_edges(bits, panel, width, lines, True, 0, out[panel * pairs * width : (panel + 1) * pairs * width])


@njit(cache=True, parallel=True)
def bf16_product(a, a_across, b, b_across, c, add):
    """c (M, N) := A B, or c + A B where `add`, with A's and B's values rounded to bf16 and the
    sums in float32 (added to c's, in k's order, where `add`: a product split along an even k into
    parts sums as the whole does). A is `a` (M, K), or a.T where a_across (a (K, M)); B is `b` (K,
    N) where b_across, else b.T (b (N, K): a weight's rows). All float32; c C-contiguous."""
    rows, columns = c.shape
    depth = a.shape[0] if a_across else a.shape[1]
    pairs = (depth + 1) // 2
    a_bits, b_bits = a.view(np.uint32), b.view(np.uint32)
    row_panels, column_panels = (rows + MR - 1) // MR, (columns + NR - 1) // NR
    a_packed = np.empty(row_panels * pairs * MR, np.uint32)
    if a_across:
        chunks = (row_panels + ACROSS_PANELS - 1) // ACROSS_PANELS
        for chunk in prange(chunks):
            first = chunk * ACROSS_PANELS
            pack_panels_across(a_bits, first, min(ACROSS_PANELS, row_panels - first), MR, rows, pairs, a_packed)
    else:
        for p in prange(row_panels):
            pack_panel(a_bits, p, MR, rows, a_across, 0, a_packed[p * pairs * MR:(p + 1) * pairs * MR])
    flat = c.reshape(rows * columns)
    # one chunk of A (few rows): each panel of B packed by the thread that multiplies it, in L1;
    # several: a block of all of B packed first, for every chunk to read
    one_chunk = row_panels <= ROW_PANELS
    b_block = np.empty(0 if one_chunk else column_panels * min(BLOCK_PAIRS, pairs) * NR, np.uint32)
    for block in range(0, pairs, BLOCK_PAIRS):
        span, adding = min(BLOCK_PAIRS, pairs - block), add or block > 0
        if not one_chunk:
            for q in prange(column_panels):
                pack_panel(b_bits, q, NR, columns, b_across, 2 * block, b_block[q * span * NR:(q + 1) * span * NR])
        for chunk in range(0, row_panels, ROW_PANELS):
            for q in prange(column_panels):
                if one_chunk:
                    b_panel, b_at = np.empty(span * NR, np.uint32), 0
                    pack_panel(b_bits, q, NR, columns, b_across, 2 * block, b_panel)
                else:
                    b_panel, b_at = b_block, q * span * NR
                edge = np.zeros(MR * NR, np.float32)
                full_columns = (q + 1) * NR <= columns
                for p in range(chunk, min(chunk + ROW_PANELS, row_panels)):
                    a_at = p * pairs * MR + block * MR
                    if full_columns and (p + 1) * MR <= rows:  # the tile is C's: written in place
                        at = p * MR * columns + q * NR
                        if adding:
                            product_tile_add(a_packed, a_at, b_panel, b_at, span, flat, at, columns)
                        else:
                            product_tile(a_packed, a_at, b_panel, b_at, span, flat, at, columns)
                        continue
                    tile_rows, tile_columns = min(MR, rows - p * MR), min(NR, columns - q * NR)
                    if adding:
                        for i in range(tile_rows):
                            for j in range(tile_columns):
                                edge[i * NR + j] = c[p * MR + i, q * NR + j]
                        product_tile_add(a_packed, a_at, b_panel, b_at, span, edge, 0, NR)
                    else:
                        product_tile(a_packed, a_at, b_panel, b_at, span, edge, 0, NR)
                    for i in range(tile_rows):
                        for j in range(tile_columns):
                            c[p * MR + i, q * NR + j] = edge[i * NR + j]
