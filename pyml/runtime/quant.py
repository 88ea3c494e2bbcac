"""GGML tensor encodings, decoded to float32 with vectorised numpy.

A GGML tensor is stored row by row, the fastest dimension last in numpy order. Quantised types cut
each row into blocks of 32 values; a block starts with float16 scale(s) and then packs the values:

    Q4_0  18 bytes: d (f16), 16 bytes of 4-bit q           value = (q - 8) * d
    Q4_1  20 bytes: d (f16), m (f16), 16 bytes of 4-bit q  value = q * d + m
    Q8_0  34 bytes: d (f16), 32 int8 q                     value = q * d

In the 4-bit types byte j holds value j in its low nibble and value j + 16 in its high nibble.
The arithmetic is done in float32 in the order written above, so the result is bit-identical to
llama.cpp's reference dequantisers (and to `gguf.quants.dequantize`, which the tests use).
"""

from enum import IntEnum
from math import prod

import numpy as np


class GGMLType(IntEnum):
    """The GGML type ids (ggml.h) of the encodings we decode."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30


# (values per block, bytes per block); plain float types are "blocks" of one value.
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q8_0: (32, 34),
}


def tensor_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (numpy order) takes; its rows must be whole blocks."""
    values_per_block, bytes_per_block = BLOCK_LAYOUT[ggml_type]
    if shape and shape[-1] % values_per_block:
        raise ValueError(
            f"rows of {shape[-1]} values are not whole {ggml_type.name} blocks of {values_per_block}"
        )
    return prod(shape) // values_per_block * bytes_per_block


def dequantize(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """A new float32 array of `shape` from the tensor's bytes `raw` (uint8, exactly its size)."""
    expected = tensor_nbytes(ggml_type, shape)
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != expected:
        raise ValueError(f"{ggml_type.name} tensor of shape {shape} needs {expected} bytes")
    # A scale of inf or NaN decodes to inf/NaN values, as in llama.cpp: no warning for that.
    with np.errstate(invalid="ignore", over="ignore"):
        return _DECODERS[ggml_type](raw).reshape(shape)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: shift its bits into place.
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _block_scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a float32 column."""
    return blocks[:, start : start + 2].view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(blocks, 16) packed bytes -> (blocks, 32) float32 values 0..15, low nibbles first."""
    values = np.empty((packed.shape[0], 32), dtype=np.uint8)
    values[:, :16] = packed & 0x0F
    values[:, 16:] = packed >> 4
    return values.astype(np.float32)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)
    d = _block_scale(blocks, 0)
    return (_nibbles(blocks[:, 2:]) - np.float32(8)) * d


def _q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 20)
    d = _block_scale(blocks, 0)
    m = _block_scale(blocks, 2)
    return _nibbles(blocks[:, 4:]) * d + m


def _q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)
    d = _block_scale(blocks, 0)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


_DECODERS = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16,
    GGMLType.BF16: _bf16,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q8_0: _q8_0,
}
