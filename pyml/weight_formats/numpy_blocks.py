"""The numpy pieces several formats' dequantizers and quantizers share: float16 fields, packed
fields in runs, rounding as C's roundf does. Blocks are 2-D, one block per row (pyml.weight_formats)."""

import numpy as np


def half_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a float32 column (blocks, 1)."""
    return blocks[:, start : start + 2].view("<f2").astype(np.float32)


def unpack(packed: np.ndarray, run: int, width: int) -> np.ndarray:
    """The `width`-bit fields of runs of `run` bytes, run after run and, within a run, field by
    field: (blocks, n) bytes -> (blocks, n * 8 // width) values, where value
    r * run * (8 // width) + k * run + i is field k (lowest bits first) of byte r * run + i."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    runs = packed.reshape(packed.shape[0], -1, 1, run)
    return ((runs >> shifts) & np.uint8((1 << width) - 1)).reshape(packed.shape[0], -1)


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(blocks, 4) bytes of a little-endian u32 -> (blocks, 32): bit j of it, shifted to 16."""
    bits = unpack(qh, 1, 1)  # value 8 * byte + bit
    return bits << np.uint8(4)


def per_sub_block(blocks: np.ndarray, start: int, factors: np.ndarray) -> np.ndarray:
    """The float16 at byte `start` of each block times each of its integer `factors`
    (blocks, n), as (blocks, n, 1) to broadcast over the sub-blocks' values."""
    return (half_column(blocks, start) * factors.astype(np.float32))[:, :, None]


def sub_blocks(q: np.ndarray, size: int) -> np.ndarray:
    return q.reshape(q.shape[0], -1, size).astype(np.float32)


def inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (a block of zeros)."""
    result = np.zeros_like(d)
    np.divide(np.float32(1), d, out=result, where=d != 0)
    return result


def half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 values (n, 1) as the two bytes of their float16, (n, 2)."""
    return values.astype(np.float16).view(np.uint8)


def nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) integers below 16 packed as (n, 16) bytes: value j low, value j + 16 high."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def packed_fifth_bits(q: np.ndarray) -> np.ndarray:
    """The fifth bits of (n, 32) levels below 32 as a little-endian uint32 (bit j: value j), (n, 4)."""
    bits = (q.astype(np.uint32) >> np.uint32(4)) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def round_half_away(values: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (np.round takes them to even).
    The fraction is compared with 0.5 exactly: floor(|x| + 0.5) would round 0.49999997 up."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.copysign(whole + (magnitude - whole >= np.float32(0.5)), values)


def largest_magnitude(blocks: np.ndarray) -> np.ndarray:
    """Each block's value of largest |x| (the first of equals), with its sign, (n, 1)."""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)


def cuda_half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block of (rows, blocks, bytes), as float32 (rows, blocks)."""
    return half_column(blocks.reshape(-1, blocks.shape[2]), start).reshape(blocks.shape[:2])


def cuda_bytes(blocks: np.ndarray, start: int, stop: int, dtype=np.uint8) -> np.ndarray:
    """Bytes start..stop of every block of (rows, blocks, bytes), a row's blocks one after
    another: (rows, ...)."""
    rows = blocks.shape[0]
    return np.ascontiguousarray(blocks[:, :, start:stop]).view(dtype).reshape(rows, -1)
