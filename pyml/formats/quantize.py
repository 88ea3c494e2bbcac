"""Encoding float32 tensors as GGML types: the inverse of `pyml.formats.quant`'s decoders.

Each row is cut into blocks of 32 values, and each block is stored as its float16 scale (and, for
Q4_1, its float16 minimum) and small integers, as `quant` describes. The arithmetic follows
llama.cpp's reference quantisers (ggml-quants.c, `quantize_row_*_ref`) step by step in float32,
so the bytes are theirs (the tests compare them with `gguf.quants.quantize`, which does the same):

    Q8_0  d = max|x| / 127                     q = round(x / d), halves away from zero
    Q4_0  d = -x_m / 8, x_m the x of largest |x|   q = min(15, trunc(x / d + 8.5))
    Q4_1  d = (max x - min x) / 15, m = min x      q = min(15, trunc((x - m) / d + 0.5))
    Q5_0  d = -x_m / 16                        q = min(31, trunc(x / d + 16.5))
    Q5_1  d = (max x - min x) / 31, m = min x      q = trunc((x - m) / d + 0.5)

where "/ d" is a multiplication by 1 / d, and by 0 when d is 0. F16 rounds each value to the
nearest float16 (ties to even), F32 keeps it. The K-quants (Q4_K, Q5_K, Q6_K: blocks of 256)
fit their scales by search and are in `quantize_k`.
"""

import numpy as np

from pyml.formats import quantize_k
from pyml.formats.quant import BLOCK_LAYOUT, GGMLType

# The types `pyml export-gguf` writes.
ENCODABLE = (GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
             GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
BLOCKS_PER_CHUNK = 4096  # 512 KiB of float32 values


def quantize(weight: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """`weight` (float32, rows of whole blocks) encoded as `ggml_type`: a float32 or float16
    array of its shape, or for the block types uint8 of shape (..., bytes per row)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if ggml_type == GGMLType.F32:
        return weight
    if ggml_type == GGMLType.F16:
        return weight.astype(np.float16)
    values_per_block, bytes_per_block = BLOCK_LAYOUT[ggml_type]
    if weight.shape[-1] % values_per_block:
        raise ValueError(f"rows of {weight.shape[-1]} values are not whole {ggml_type.name} blocks")
    blocks = weight.reshape(-1, values_per_block)
    encoded = np.empty((len(blocks), bytes_per_block), np.uint8)
    # A chunk at a time, so that the temporaries stay in cache instead of streaming through memory.
    for start in range(0, len(blocks), BLOCKS_PER_CHUNK):
        chunk = slice(start, start + BLOCKS_PER_CHUNK)
        encoded[chunk] = _ENCODERS[ggml_type](blocks[chunk])
    row_bytes = weight.shape[-1] // values_per_block * bytes_per_block
    return encoded.reshape(*weight.shape[:-1], row_bytes)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (a block of zeros)."""
    inverse = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inverse, where=d != 0)
    return inverse


def _half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 values (n, 1) as the two bytes of their float16, (n, 2)."""
    return values.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) integers below 16 packed as (n, 16) bytes: value j low, value j + 16 high."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _round_half_away(values: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (np.round takes them to even).
    The fraction is compared with 0.5 exactly: floor(|x| + 0.5) would round 0.49999997 up."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.copysign(whole + (magnitude - whole >= np.float32(0.5)), values)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_half_away(blocks * _inverse(d))
    return np.concatenate([_half_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    d = largest / np.float32(-8)
    q = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(8.5)), 15)
    return np.concatenate([_half_bytes(d), _nibbles(q)], axis=1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(15)
    q = np.minimum(np.trunc((blocks - low) * _inverse(d) + np.float32(0.5)), 15)
    return np.concatenate([_half_bytes(d), _half_bytes(low), _nibbles(q)], axis=1)


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """The fifth bits of (n, 32) levels below 32 as a little-endian uint32 (bit j: value j), (n, 4)."""
    bits = (q.astype(np.uint32) >> np.uint32(4)) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    d = largest / np.float32(-16)
    q = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_half_bytes(d), _fifth_bits(q), _nibbles(q & np.uint8(0xF))], axis=1)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(31)
    q = np.trunc((blocks - low) * _inverse(d) + np.float32(0.5)).astype(np.uint8)
    return np.concatenate([_half_bytes(d), _half_bytes(low), _fifth_bits(q), _nibbles(q & np.uint8(0xF))],
                          axis=1)


_ENCODERS = {GGMLType.Q8_0: _q8_0, GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1,
             GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1, GGMLType.Q4_K: quantize_k.q4_k,
             GGMLType.Q5_K: quantize_k.q5_k, GGMLType.Q6_K: quantize_k.q6_k}
