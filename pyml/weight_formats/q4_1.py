"""Q4_1: blocks of 32 values in 20 bytes, float16 d and m then 16 bytes of nibbles (byte j: value
j low, value j + 16 high); value = q * d + m.

llama.cpp's reference quantizer (quantize_row_q4_1_ref): d = (max x - min x) / 15, m = min x,
q = min(15, trunc((x - m) / d + 0.5)), "/ d" a multiplication by 1 / d (by 0 when d is 0)."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, Int8Layout, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    d, m = nb.half_column(blocks, 0), nb.half_column(blocks, 2)
    return nb.unpack(blocks[:, 4:], 16, 4).astype(np.float32) * d + m


def quantize(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(15)
    q = np.minimum(np.trunc((blocks - low) * nb.inverse(d) + np.float32(0.5)), 15)
    return np.concatenate([nb.half_bytes(d), nb.half_bytes(low), nb.nibbles(q)], axis=1)


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 32, 20, row) as (block, start):
        d = vir.splat(builder, vir.half_at(builder, block, 0), 16)
        m = vir.splat(builder, vir.half_at(builder, block, 2), 16)
        for half, nibbles in enumerate(vir.nibbles_at(builder, block, 4)):
            q = builder.uitofp(nibbles, vir.vector_type(vir.F32, 16))
            use(builder.fadd(builder.fmul(q, d), m), builder.add(start, vir.index(16 * half)))


def cuda_arrays(blocks):
    """values uint8 (in/2), scale = d (in/32), offset = m (in/32): weight = q * scale + offset."""
    return nb.cuda_bytes(blocks, 4, 20), nb.cuda_half(blocks, 0), nb.cuda_half(blocks, 2)


FORMAT = WeightFormat(GGMLType.Q4_1, 32, 20, dequantize, quantize, row_values,
                      int8=Int8Layout(values_at=4, four_bit=True, offset_at=2), cuda_arrays=cuda_arrays)
