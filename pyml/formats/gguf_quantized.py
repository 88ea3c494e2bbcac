"""GGUF weight matrices kept quantized, laid out for the CUDA decode step's linear maps.

A GGUF stores a matrix row by row, each row as blocks that interleave float16 scales with packed
integers (pyml/weight_formats). The CUDA kernels (pyml/package/quantized_cuda.py) read one weight
row as a few contiguous arrays instead: the packed integers exactly as the file stores them, block
after block, and the scales (and offsets) decoded to float32, one per block or sub-block. So a
weight costs the same bits as in the file plus 4 bytes per scale (Q4_1: 24 bytes per 32 weights
instead of 20), and a row's integers load as whole vectors. Each format's module says which
arrays it splits into (`WeightFormat.cuda_arrays`); the formats without them are not kept
quantized on the GPU.

Each product scale = d * sc is exact in float32, and so is each weight q * scale + offset where
gguf computes it in that order: the kernels' dequantized weights are gguf's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyml.errors import PymlError
from pyml.weight_formats import FORMATS, GGMLType

# the formats kept quantized on the GPU
KEPT = tuple(ggml_type for ggml_type, format in FORMATS.items() if format.cuda_arrays is not None)


@dataclass(frozen=True)
class QuantizedMatrix:
    """An (out_features, in_features) weight matrix as its kernel reads it: `arrays` are the
    kernel's weight arguments, in order."""

    ggml_type: GGMLType
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
        ggml_type = GGMLType(type_id)
    except ValueError:
        raise PymlError(f"unknown GGML type id {type_id}") from None
    if ggml_type not in KEPT:
        kept = ", ".join(t.name for t in KEPT)
        raise PymlError(f"{ggml_type.name} weights cannot be kept quantized (only {kept})")
    if len(shape) != 2:
        raise PymlError(f"a quantized weight matrix has 2 dimensions, not shape {shape}")
    rows, columns = shape
    format = FORMATS[ggml_type]
    if columns % format.block_values:
        raise PymlError(f"rows of {columns} values are not whole {ggml_type.name} blocks of {format.block_values}")
    expected = rows * columns // format.block_values * format.block_bytes
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != expected:
        raise PymlError(f"{ggml_type.name} matrix of shape {shape} needs {expected} bytes")
    blocks = raw.reshape(rows, columns // format.block_values, format.block_bytes)
    return QuantizedMatrix(ggml_type, (rows, columns), format.cuda_arrays(blocks))
