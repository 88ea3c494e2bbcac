"""Q5_K: blocks of 256 values in 176 bytes, 8 sub-blocks of 32: float16 d and dmin, 12 bytes of
6-bit scales and mins (as Q4_K's), 32 bytes of fifth bits, 128 bytes of nibbles in 4 runs of 32
(as Q4_K's); the fifth bit of value 64 r + 32 h + i is bit 2 r + h of fifth-bit byte i; value =
(d * scale_j) * (q + 16 * bit) - (dmin * min_j).

The quantizer is llama.cpp's quantize_row_q5_K_ref (k_fitting.py)."""

import numpy as np

from pyml.weight_formats import k_fitting, numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.q4_k import row_scales, scale_and_min
from pyml.weight_formats.traits import GGMLType, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    scale, minimum = scale_and_min(blocks)
    q = nb.unpack(blocks[:, 48:176], 32, 4) | (nb.unpack(blocks[:, 16:48], 32, 1) << np.uint8(4))
    return scale * nb.sub_blocks(q, 32) - minimum


def quantize(blocks: np.ndarray) -> np.ndarray:
    """Q4_K's, with the fifth bit of value j + 64 i (and of j + 64 i + 32) in bit 2 i (2 i + 1) of
    byte j of 32."""
    halves, packed, levels = k_fitting.k_scales(blocks, 31, -0.5, 0.1, 15)
    pairs = levels.reshape(-1, 4, 2, 32)
    nibbles = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    fifth = (pairs >> 4).astype(np.uint8)  # (n, 4, 2, 32)
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)[None, :, :, None]
    high = np.bitwise_or.reduce((fifth << shifts).reshape(-1, 8, 32), axis=1)
    return np.concatenate([halves, packed, high, nibbles], axis=1)


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 256, 176, row) as (block, start):
        scales = row_scales(builder, block)
        fifth = vir.load(builder, block, vir.index(16), vir.I8, 32)
        for run in range(4):
            packed = vir.load(builder, block, vir.index(48 + 32 * run), vir.I8, 32)
            nibbles = (builder.and_(packed, vir.byte_vector(15, 32)), builder.lshr(packed, vir.byte_vector(4, 32)))
            for half in range(2):
                bit = builder.and_(builder.lshr(fifth, vir.byte_vector(2 * run + half, 32)), vir.byte_vector(1, 32))
                q = builder.or_(nibbles[half], builder.shl(bit, vir.byte_vector(4, 32)))
                scale, minimum = (vir.lane_splat(builder, vector, 2 * run + half, 32) for vector in scales)
                q = builder.uitofp(q, vir.vector_type(vir.F32, 32))
                use(builder.fsub(builder.fmul(scale, q), minimum),
                    builder.add(start, vir.index(64 * run + 32 * half)))


FORMAT = WeightFormat(GGMLType.Q5_K, 256, 176, dequantize, quantize, row_values)
