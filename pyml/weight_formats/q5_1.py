"""Q5_1: blocks of 32 values in 24 bytes, float16 d and m, a little-endian u32 qh of fifth bits
(bit j: value j), 16 bytes of low nibbles; value = q * d + m. The decode step has no loop of its
own for it: such a tensor becomes float32 rows.

llama.cpp's reference quantizer (quantize_row_q5_1_ref): d = (max x - min x) / 31, m = min x,
q = trunc((x - m) / d + 0.5), "/ d" a multiplication by 1 / d (by 0 when d is 0)."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb
from pyml.weight_formats.traits import GGMLType, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    d, m = nb.half_column(blocks, 0), nb.half_column(blocks, 2)
    q = nb.unpack(blocks[:, 8:], 16, 4) | nb.fifth_bits(blocks[:, 4:8])
    return q.astype(np.float32) * d + m


def quantize(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(31)
    q = np.trunc((blocks - low) * nb.inverse(d) + np.float32(0.5)).astype(np.uint8)
    return np.concatenate([nb.half_bytes(d), nb.half_bytes(low), nb.packed_fifth_bits(q),
                           nb.nibbles(q & np.uint8(0xF))], axis=1)


FORMAT = WeightFormat(GGMLType.Q5_1, 32, 24, dequantize, quantize)
