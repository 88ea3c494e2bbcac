"""Q2_K: blocks of 256 values in 84 bytes, 16 sub-blocks of 16: 16 bytes of (4-bit scale | 4-bit
min << 4), 64 bytes of 2-bit q in runs of 32, float16 d and dmin; value = (d * scale) * q -
(dmin * min). pyml reads it only: the decode step turns such a tensor into float32 rows."""

import numpy as np

from pyml.weight_formats import numpy_blocks as nb
from pyml.weight_formats.traits import GGMLType, WeightFormat


def dequantize(blocks: np.ndarray) -> np.ndarray:
    scales = blocks[:, :16]
    q = nb.unpack(blocks[:, 16:80], 32, 2)
    scale = nb.per_sub_block(blocks, 80, scales & np.uint8(0x0F))
    minimum = nb.per_sub_block(blocks, 82, scales >> np.uint8(4))
    return scale * nb.sub_blocks(q, 16) - minimum


FORMAT = WeightFormat(GGMLType.Q2_K, 256, 84, dequantize)
