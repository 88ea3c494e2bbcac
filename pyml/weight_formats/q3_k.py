"""Q3_K: blocks of 256 values in 110 bytes, 16 sub-blocks of 16: 32 bytes of high bits (one run of
32), 64 bytes of 2-bit low q (runs of 32), 12 bytes of 6-bit scales, float16 d; value = (d *
(scale - 32)) * (q - 4 * (1 - high bit)). pyml reads it only: the decode step turns such a tensor
into float32 rows."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb
from pyml.weight_formats.traits import GGMLType, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    high = nb.unpack(blocks[:, :32], 32, 1)
    low = nb.unpack(blocks[:, 32:96], 32, 2)
    # A clear high bit means q = low - 4, a set one q = low.
    q = low.astype(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    # 16 six-bit scales, offset by 32: their low nibbles fill bytes 0..7 (scales 0..7 the low
    # nibbles, 8..15 the high ones), their top two bits bytes 8..11 (2 bits each, 4 per byte).
    packed = blocks[:, 96:108]
    six_bits = nb.unpack(packed[:, :8], 8, 4) | (nb.unpack(packed[:, 8:], 4, 2) << np.uint8(4))
    scale = nb.per_sub_block(blocks, 108, six_bits.astype(np.int8) - np.int8(32))
    return scale * nb.sub_blocks(q, 16)


FORMAT = WeightFormat(GGMLType.Q3_K, 256, 110, dequantize)
