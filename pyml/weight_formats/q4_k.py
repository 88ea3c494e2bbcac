"""Q4_K: blocks of 256 values in 144 bytes, 8 sub-blocks of 32: float16 d and dmin, 12 bytes of
6-bit scales and mins, 128 bytes of nibbles in 4 runs of 32 (run r: values 64 r .. 64 r + 31 in
the low nibbles, the next 32 in the high ones); sub-block j's value = (d * scale_j) * q - (dmin *
min_j).

The 8 six-bit scales and 8 six-bit mins fill bytes 4..15: bytes 4..7 hold scales 0..3 and, in
their top two bits, the top bits of scales 4..7; bytes 8..11 the same for the mins; bytes 12..15
the low nibbles of scales 4..7 (low nibble) and of mins 4..7 (high nibble). Q5_K's are the same.

The quantizer is llama.cpp's quantize_row_q4_K_ref (k_fitting.py)."""

import numpy as np
from llvmlite import ir

from pyml.weight_formats import k_fitting, numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, WeightFormat


def scale_and_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * scale, dmin * min) of the 8 sub-blocks of a Q4_K or Q5_K block, each (blocks, 8, 1)."""
    scale_bytes, min_bytes, nibble_bytes = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    six_bits, top_bits = np.uint8(0x3F), np.uint8(0x30)
    scales = np.concatenate(
        [scale_bytes & six_bits,
         (nibble_bytes & np.uint8(0x0F)) | ((scale_bytes >> np.uint8(2)) & top_bits)],
        axis=1,
    )
    mins = np.concatenate(
        [min_bytes & six_bits,
         (nibble_bytes >> np.uint8(4)) | ((min_bytes >> np.uint8(2)) & top_bits)],
        axis=1,
    )
    return nb.per_sub_block(blocks, 0, scales), nb.per_sub_block(blocks, 2, mins)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    scale, minimum = scale_and_min(blocks)
    q = nb.unpack(blocks[:, 16:144], 32, 4)
    return scale * nb.sub_blocks(q, 32) - minimum


def quantize(blocks: np.ndarray) -> np.ndarray:
    """d, dmin, 12 bytes of scales and mins, and the levels as nibbles, values j and j + 32 of
    each 64 sharing a byte."""
    halves, packed, levels = k_fitting.k_scales(blocks, 15, -1.0, 0.1, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([halves, packed, nibbles], axis=1)


def row_scales(builder, block):
    """(d * scale, dmin * min) of a Q4_K (or Q5_K) block's 8 sub-blocks, two <8 x float> vectors
    (all in vector lanes: scalar code per sub-block made the row's loop 1.2x slower, 2026-12-05)."""
    d, dmin = vir.half_at(builder, block, 0), vir.half_at(builder, block, 2)
    header = vir.load(builder, block, vir.index(0), vir.I8, 16)
    lanes = vir.vector_type(vir.I8, 8)

    def six_bits(low, shift, top):  # (low >> shift) & mask, with top's two high bits above a nibble
        low = builder.lshr(vir.bytes_at(builder, header, low), ir.Constant(lanes, shift))
        low = builder.and_(low, ir.Constant(lanes, [0x3F] * 4 + [15] * 4))
        top = builder.lshr(vir.bytes_at(builder, header, [None] * 4 + top), ir.Constant(lanes, [6] * 8))
        return builder.or_(low, builder.shl(top, ir.Constant(lanes, [4] * 8)))

    scales = six_bits([4, 5, 6, 7, 12, 13, 14, 15], [0] * 8, [4, 5, 6, 7])
    minimums = six_bits([8, 9, 10, 11, 12, 13, 14, 15], [0] * 4 + [4] * 4, [8, 9, 10, 11])
    floats = vir.vector_type(vir.F32, 8)
    return (builder.fmul(vir.splat(builder, d, 8), builder.uitofp(scales, floats)),
            builder.fmul(vir.splat(builder, dmin, 8), builder.uitofp(minimums, floats)))


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 256, 144, row) as (block, start):
        scales = row_scales(builder, block)
        for run in range(4):
            packed = vir.load(builder, block, vir.index(16 + 32 * run), vir.I8, 32)
            nibbles = (builder.and_(packed, vir.byte_vector(15, 32)), builder.lshr(packed, vir.byte_vector(4, 32)))
            for half in range(2):
                scale, minimum = (vir.lane_splat(builder, vector, 2 * run + half, 32) for vector in scales)
                q = builder.uitofp(nibbles[half], vir.vector_type(vir.F32, 32))
                use(builder.fsub(builder.fmul(scale, q), minimum),
                    builder.add(start, vir.index(64 * run + 32 * half)))


def cuda_arrays(blocks):
    """values uint8 (in/2), scale = d * sc (in/32), offset = -dmin * min (in/32): weight = q *
    scale + offset."""
    rows = blocks.shape[0]
    scale, minimum = scale_and_min(blocks.reshape(-1, 144))
    return (nb.cuda_bytes(blocks, 16, 144), np.ascontiguousarray(scale.reshape(rows, -1)),
            np.ascontiguousarray(-minimum.reshape(rows, -1)))


FORMAT = WeightFormat(GGMLType.Q4_K, 256, 144, dequantize, quantize, row_values, cuda_arrays=cuda_arrays)
