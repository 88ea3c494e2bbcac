"""Q4_0: blocks of 32 values in 18 bytes, float16 d then 16 bytes of nibbles (byte j: value j low,
value j + 16 high); value = (q - 8) * d.

llama.cpp's reference quantizer (quantize_row_q4_0_ref): d = -x_m / 8, x_m the value of largest
|x|, q = min(15, trunc(x / d + 8.5)), "/ d" a multiplication by 1 / d (by 0 when d is 0)."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, Int8Layout, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    d = nb.half_column(blocks, 0)
    return (nb.unpack(blocks[:, 2:], 16, 4).astype(np.float32) - np.float32(8)) * d


def quantize(blocks: np.ndarray) -> np.ndarray:
    d = nb.largest_magnitude(blocks) / np.float32(-8)
    q = np.minimum(np.trunc(blocks * nb.inverse(d) + np.float32(8.5)), 15)
    return np.concatenate([nb.half_bytes(d), nb.nibbles(q)], axis=1)


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 32, 18, row) as (block, start):
        d = vir.splat(builder, vir.half_at(builder, block, 0), 16)
        for half, nibbles in enumerate(vir.nibbles_at(builder, block, 2)):
            q = builder.sitofp(builder.sub(nibbles, vir.byte_vector(8, 16)), vir.vector_type(vir.F32, 16))
            use(builder.fmul(q, d), builder.add(start, vir.index(16 * half)))


def cuda_arrays(blocks):
    """values uint8 (in/2), scale (in/32), offset = -8 * scale: weight = q * scale + offset."""
    scale = nb.cuda_half(blocks, 0)
    return nb.cuda_bytes(blocks, 2, 18), scale, scale * np.float32(-8)


FORMAT = WeightFormat(GGMLType.Q4_0, 32, 18, dequantize, quantize, row_values,
                      int8=Int8Layout(values_at=2, four_bit=True, offset_at=None), cuda_arrays=cuda_arrays)
