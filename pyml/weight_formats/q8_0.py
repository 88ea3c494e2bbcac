"""Q8_0: blocks of 32 values in 34 bytes, float16 d then 32 int8 q; value = q * d.

llama.cpp's reference quantizer (quantize_row_q8_0_ref): d = max |x| / 127, q = round(x / d),
halves away from zero, "/ d" a multiplication by 1 / d (by 0 when d is 0)."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, Int8Layout, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:].view(np.int8).astype(np.float32) * nb.half_column(blocks, 0)


def quantize(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    q = nb.round_half_away(blocks * nb.inverse(d))
    return np.concatenate([nb.half_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def row_values(builder, row, values, use):
    with vir.block_loop(builder, values, 32, 34, row) as (block, start):
        q = builder.sitofp(vir.load(builder, block, vir.index(2), vir.I8, 32), vir.vector_type(vir.F32, 32))
        use(builder.fmul(q, vir.splat(builder, vir.half_at(builder, block, 0), 32)), start)


def cuda_arrays(blocks):
    """values int8 (in), scale (in/32): weight = q * scale."""
    return nb.cuda_bytes(blocks, 2, 34, np.int8), nb.cuda_half(blocks, 0)


FORMAT = WeightFormat(GGMLType.Q8_0, 32, 34, dequantize, quantize, row_values,
                      int8=Int8Layout(values_at=2, four_bit=False, offset_at=None), cuda_arrays=cuda_arrays)
