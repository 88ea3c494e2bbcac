"""GGUF weight matrices kept quantized, laid out for the decode step's linear maps.

A GGUF stores a matrix row by row, each row as blocks that interleave float16 scales with packed
integers (pyml/formats/quant.py describes them). The kernels (pyml/package/quantized_dot.py) read
one weight row as a few contiguous arrays instead: the packed integers exactly as the file
stores them, block after block, and the scales (and offsets) decoded to float32, one per block or
sub-block. So a weight costs the same bits as in the file plus 4 bytes per scale (Q4_1: 24 bytes
per 32 weights instead of 20), and a row's integers load as whole vectors.

    type   arrays (each (rows, ...), C-contiguous)                         weight
    Q8_0   values int8 (in), scale (in/32)                                 q * scale
    Q4_0   values uint8 (in/2), scale (in/32), offset = -8 * scale         q * scale + offset
    Q4_1   values uint8 (in/2), scale = d (in/32), offset = m (in/32)      q * scale + offset
    Q5_0   values uint8 (in/2), high uint8 (in/8): the fifth bits (qh),    (q | h << 4) * scale
           scale (in/32), offset = -16 * scale                             + offset
    Q4_K   values uint8 (in/2), scale = d * sc (in/32), offset = -dmin * min (in/32)
    Q6_K   low uint8 (in/2), high uint8 (in/4), scale = d * sc (in/16)     (q - 32) * scale

Each product scale = d * sc is exact in float32, and so is each weight q * scale + offset where
gguf computes it in that order: the kernels' dequantized weights are gguf's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GGML

from pyml.errors import PymlError

# values per block and bytes per block of each type we keep quantized
BLOCKS = {GGML.Q8_0: (32, 34), GGML.Q4_0: (32, 18), GGML.Q4_1: (32, 20), GGML.Q5_0: (32, 22),
          GGML.Q4_K: (256, 144), GGML.Q6_K: (256, 210)}


@dataclass(frozen=True)
class QuantizedMatrix:
    """An (out_features, in_features) weight matrix as its kernel reads it: `arrays` are the
    kernel's weight arguments, in order."""

    ggml_type: GGML
    shape: tuple[int, int]
    arrays: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)

    def rows(self, order: np.ndarray) -> QuantizedMatrix:
        """The matrix with its rows reordered (row i is row order[i] of this one)."""
        return QuantizedMatrix(self.ggml_type, self.shape,
                               tuple(np.ascontiguousarray(array[order]) for array in self.arrays))


def quantized_matrix(raw: np.ndarray, type_id: int, shape: tuple[int, int]) -> QuantizedMatrix:
    """The matrix of `shape` (numpy order: rows, then the values of a row) from its GGUF bytes."""
    try:
        ggml_type = GGML(type_id)
    except ValueError:
        raise PymlError(f"unknown GGML type id {type_id}") from None
    if ggml_type not in BLOCKS:
        kept = ", ".join(t.name for t in BLOCKS)
        raise PymlError(f"{ggml_type.name} weights cannot be kept quantized (only {kept})")
    if len(shape) != 2:
        raise PymlError(f"a quantized weight matrix has 2 dimensions, not shape {shape}")
    rows, columns = shape
    values_per_block, bytes_per_block = BLOCKS[ggml_type]
    if columns % values_per_block:
        raise PymlError(f"rows of {columns} values are not whole {ggml_type.name} blocks of {values_per_block}")
    expected = rows * columns // values_per_block * bytes_per_block
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != expected:
        raise PymlError(f"{ggml_type.name} matrix of shape {shape} needs {expected} bytes")
    blocks = raw.reshape(rows, columns // values_per_block, bytes_per_block)
    return QuantizedMatrix(ggml_type, (rows, columns), _LAYOUTS[ggml_type](blocks))


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 (rows, blocks)."""
    return np.ascontiguousarray(blocks[:, :, start:start + 2]).view("<f2")[:, :, 0].astype(np.float32)


def _bytes(blocks: np.ndarray, start: int, stop: int, dtype=np.uint8) -> np.ndarray:
    """Bytes start..stop of every block, the blocks of a row one after another: (rows, ...)."""
    rows = blocks.shape[0]
    return np.ascontiguousarray(blocks[:, :, start:stop]).view(dtype).reshape(rows, -1)


def _q8_0(blocks):
    return _bytes(blocks, 2, 34, np.int8), _half(blocks, 0)


def _q4_0(blocks):
    scale = _half(blocks, 0)
    return _bytes(blocks, 2, 18), scale, scale * np.float32(-8)


def _q4_1(blocks):
    return _bytes(blocks, 4, 20), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks):
    scale = _half(blocks, 0)
    return _bytes(blocks, 6, 22), _bytes(blocks, 2, 6), scale, scale * np.float32(-16)


def _q4_k(blocks):
    # 8 six-bit scales and 8 six-bit mins in bytes 4..15: bytes 4..7 hold scales 0..3 (and in their
    # top two bits the top bits of scales 4..7), bytes 8..11 the same for the mins, bytes 12..15 the
    # low nibbles of scales 4..7 (low nibble) and of mins 4..7 (high nibble).
    scale_bytes, min_bytes, nibble_bytes = blocks[:, :, 4:8], blocks[:, :, 8:12], blocks[:, :, 12:16]
    six_bits, top_bits = np.uint8(0x3F), np.uint8(0x30)
    scales = np.concatenate([scale_bytes & six_bits,
                             (nibble_bytes & np.uint8(0x0F)) | ((scale_bytes >> np.uint8(2)) & top_bits)],
                            axis=2)
    mins = np.concatenate([min_bytes & six_bits,
                           (nibble_bytes >> np.uint8(4)) | ((min_bytes >> np.uint8(2)) & top_bits)],
                          axis=2)
    rows = blocks.shape[0]
    scale = (_half(blocks, 0)[:, :, None] * scales.astype(np.float32)).reshape(rows, -1)
    offset = -(_half(blocks, 2)[:, :, None] * mins.astype(np.float32)).reshape(rows, -1)
    return _bytes(blocks, 16, 144), np.ascontiguousarray(scale), np.ascontiguousarray(offset)


def _q6_k(blocks):
    rows = blocks.shape[0]
    scales = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).astype(np.float32)
    scale = (_half(blocks, 208)[:, :, None] * scales).reshape(rows, -1)
    return _bytes(blocks, 0, 128), _bytes(blocks, 128, 192), np.ascontiguousarray(scale)


_LAYOUTS = {GGML.Q8_0: _q8_0, GGML.Q4_0: _q4_0, GGML.Q4_1: _q4_1, GGML.Q5_0: _q5_0,
            GGML.Q4_K: _q4_k, GGML.Q6_K: _q6_k}
