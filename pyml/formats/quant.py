"""GGML tensor encodings, decoded to float32 with vectorised numpy.

A GGML tensor is stored row by row, the fastest dimension last in numpy order. Quantised types cut
each row into blocks and store a block as float16 scale(s) followed by packed integers.

The simple types have blocks of 32 values; byte j of the packed nibbles holds value j in its low
nibble and value j + 16 in its high nibble, and in the 5-bit types bit j of the u32 `qh` is the
fifth bit of value j:

    Q4_0  18 bytes: d, 16 bytes of 4-bit q                   value = (q - 8) * d
    Q4_1  20 bytes: d, m, 16 bytes of 4-bit q                value = q * d + m
    Q5_0  22 bytes: d, qh (u32), 16 bytes of low nibbles     value = (q - 16) * d
    Q5_1  24 bytes: d, m, qh (u32), 16 bytes of low nibbles  value = q * d + m
    Q8_0  34 bytes: d, 32 int8 q                             value = q * d

The K-quants ("super-blocks") hold 256 values in sub-blocks of 16 or 32 that share the block's
float16 d (and dmin) through small integer scales (and mins):

    Q2_K   84 bytes: 16 x (4-bit scale | 4-bit min << 4), 64 bytes of 2-bit q, d, dmin
                     16 sub-blocks of 16    value = (d * scale) * q - (dmin * min)
    Q3_K  110 bytes: 32 bytes of high bits, 64 bytes of 2-bit low q, 12 bytes of 6-bit scales, d
                     16 sub-blocks of 16    value = (d * (scale - 32)) * (q - 4 * (1 - high bit))
    Q4_K  144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q
                     8 sub-blocks of 32     value = (d * scale) * q - (dmin * min)
    Q5_K  176 bytes: d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 of nibbles
                     8 sub-blocks of 32     value = (d * scale) * q - (dmin * min)
    Q6_K  210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high q, 16 int8 scales, d
                     16 sub-blocks of 16    value = (d * scale) * (q - 32)

Packed fields come in runs: a run of n bytes holds 8 // width runs of n values, field k of its
byte i being value k * n + i (the low nibbles of 16 bytes are values 0..15, the high ones
16..31). The K-quants pack their 2-bit fields in runs of 32 bytes, their 4-bit ones in runs of 32
(Q6_K: 64) and their single high bits in one run of 32.

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
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    F64 = 28  # float64 safetensors (the reference tests' checkpoints); no GGUF tensor of it is read
    BF16 = 30


# (values per block, bytes per block) of the types a GGUF may hold and `dequantize` decodes; plain
# float types are "blocks" of one value.
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
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
    values_per_block, bytes_per_block = BLOCK_LAYOUT[ggml_type]
    blocks = raw.reshape(-1, bytes_per_block)
    # A scale of inf or NaN decodes to inf/NaN values, as in llama.cpp: no warning for that.
    with np.errstate(invalid="ignore", over="ignore"):
        return _DECODERS[ggml_type](blocks).reshape(shape)


def _f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f4").astype(np.float32)


def _f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f2").astype(np.float32)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: shift its bits into place.
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a float32 column (blocks, 1)."""
    return blocks[:, start : start + 2].view("<f2").astype(np.float32)


def _unpack(packed: np.ndarray, run: int, width: int) -> np.ndarray:
    """The `width`-bit fields of runs of `run` bytes, run after run and, within a run, field by
    field: (blocks, n) bytes -> (blocks, n * 8 // width) values, where value
    r * run * (8 // width) + k * run + i is field k (lowest bits first) of byte r * run + i."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    runs = packed.reshape(packed.shape[0], -1, 1, run)
    return ((runs >> shifts) & np.uint8((1 << width) - 1)).reshape(packed.shape[0], -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(blocks, 4) bytes of a little-endian u32 -> (blocks, 32): bit j of it, shifted to 16."""
    bits = _unpack(qh, 1, 1)  # value 8 * byte + bit
    return bits << np.uint8(4)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks, 0)
    return (_unpack(blocks[:, 2:], 16, 4).astype(np.float32) - np.float32(8)) * d


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _half(blocks, 0), _half(blocks, 2)
    return _unpack(blocks[:, 4:], 16, 4).astype(np.float32) * d + m


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks, 0)
    q = _unpack(blocks[:, 6:], 16, 4) | _fifth_bits(blocks[:, 2:6])
    return (q.astype(np.float32) - np.float32(16)) * d


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _unpack(blocks[:, 8:], 16, 4) | _fifth_bits(blocks[:, 4:8])
    return q.astype(np.float32) * d + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks, 0)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def _per_sub_block(blocks: np.ndarray, start: int, factors: np.ndarray) -> np.ndarray:
    """The float16 at byte `start` of each block times each of its integer `factors`
    (blocks, n), as (blocks, n, 1) to broadcast over the sub-blocks' values."""
    return (_half(blocks, start) * factors.astype(np.float32))[:, :, None]


def _sub_blocks(q: np.ndarray, size: int) -> np.ndarray:
    return q.reshape(q.shape[0], -1, size).astype(np.float32)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    scales = blocks[:, :16]
    q = _unpack(blocks[:, 16:80], 32, 2)
    scale = _per_sub_block(blocks, 80, scales & np.uint8(0x0F))
    minimum = _per_sub_block(blocks, 82, scales >> np.uint8(4))
    return scale * _sub_blocks(q, 16) - minimum


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    high = _unpack(blocks[:, :32], 32, 1)
    low = _unpack(blocks[:, 32:96], 32, 2)
    # A clear high bit means q = low - 4, a set one q = low.
    q = low.astype(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    # 16 six-bit scales, offset by 32: their low nibbles fill bytes 0..7 (scales 0..7 the low
    # nibbles, 8..15 the high ones), their top two bits bytes 8..11 (2 bits each, 4 per byte).
    packed = blocks[:, 96:108]
    six_bits = _unpack(packed[:, :8], 8, 4) | (_unpack(packed[:, 8:], 4, 2) << np.uint8(4))
    scale = _per_sub_block(blocks, 108, six_bits.astype(np.int8) - np.int8(32))
    return scale * _sub_blocks(q, 16)


def _k_scale_and_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * scale, dmin * min) of the 8 sub-blocks of a Q4_K or Q5_K block, each (blocks, 8, 1).

    The 8 six-bit scales and 8 six-bit mins fill bytes 4..15: bytes 4..7 hold scales 0..3 and,
    in their top two bits, the top bits of scales 4..7; bytes 8..11 the same for the mins; bytes
    12..15 the low nibbles of scales 4..7 (low nibble) and of mins 4..7 (high nibble).
    """
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
    return _per_sub_block(blocks, 0, scales), _per_sub_block(blocks, 2, mins)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    scale, minimum = _k_scale_and_min(blocks)
    q = _unpack(blocks[:, 16:144], 32, 4)
    return scale * _sub_blocks(q, 32) - minimum


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    scale, minimum = _k_scale_and_min(blocks)
    q = _unpack(blocks[:, 48:176], 32, 4) | (_unpack(blocks[:, 16:48], 32, 1) << np.uint8(4))
    return scale * _sub_blocks(q, 32) - minimum


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    low = _unpack(blocks[:, :128], 64, 4)
    high = _unpack(blocks[:, 128:192], 32, 2)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _per_sub_block(blocks, 208, blocks[:, 192:208].view(np.int8))
    return scale * _sub_blocks(q, 16)


_DECODERS = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16,
    GGMLType.BF16: _bf16,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
