"""Q5_0: blocks of 32 values in 22 bytes, float16 d, a little-endian u32 qh of fifth bits (bit j:
value j), 16 bytes of low nibbles (byte j: value j low, value j + 16 high); value = (q - 16) * d.

llama.cpp's reference quantizer (quantize_row_q5_0_ref): d = -x_m / 16, x_m the value of largest
|x|, q = min(31, trunc(x / d + 16.5)), "/ d" a multiplication by 1 / d (by 0 when d is 0)."""

import numpy as np
from llvmlite import ir

from pyml.weight_formats import numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    d = nb.half_column(blocks, 0)
    q = nb.unpack(blocks[:, 6:], 16, 4) | nb.fifth_bits(blocks[:, 2:6])
    return (q.astype(np.float32) - np.float32(16)) * d


def quantize(blocks: np.ndarray) -> np.ndarray:
    d = nb.largest_magnitude(blocks) / np.float32(-16)
    q = np.minimum(np.trunc(blocks * nb.inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([nb.half_bytes(d), nb.packed_fifth_bits(q), nb.nibbles(q & np.uint8(0xF))], axis=1)


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 32, 22, row) as (block, start):
        d = vir.splat(builder, vir.half_at(builder, block, 0), 16)
        fifth = vir.load(builder, block, vir.index(2), vir.I8, 4)
        for half, nibbles in enumerate(vir.nibbles_at(builder, block, 6)):
            # values 16 * half + i, i < 16: bit i % 8 of byte 2 * half + i // 8
            spread = builder.shuffle_vector(
                fifth, ir.Constant(fifth.type, ir.Undefined),
                ir.Constant(vir.vector_type(vir.I32, 16), [2 * half + i // 8 for i in range(16)]))
            bits = builder.and_(
                builder.lshr(spread, ir.Constant(vir.vector_type(vir.I8, 16), [i % 8 for i in range(16)])),
                vir.byte_vector(1, 16))
            q = builder.sub(builder.or_(nibbles, builder.shl(bits, vir.byte_vector(4, 16))), vir.byte_vector(16, 16))
            use(builder.fmul(builder.sitofp(q, vir.vector_type(vir.F32, 16)), d),
                builder.add(start, vir.index(16 * half)))


def cuda_arrays(blocks):
    """values uint8 (in/2), high uint8 (in/8): the fifth bits (qh), scale (in/32), offset = -16 *
    scale: weight = (q | h << 4) * scale + offset."""
    scale = nb.cuda_half(blocks, 0)
    return nb.cuda_bytes(blocks, 6, 22), nb.cuda_bytes(blocks, 2, 6), scale, scale * np.float32(-16)


FORMAT = WeightFormat(GGMLType.Q5_0, 32, 22, dequantize, quantize, row_values, cuda_arrays=cuda_arrays)
