"""What pyml knows of one weight format, ggml's "type traits": `WeightFormat`, one per module of
this package, and `GGMLType`, the ids (ggml.h) that name the formats in a GGUF and in the decode
step's row kinds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np


class GGMLType(IntEnum):
    """The GGML type ids of the encodings pyml reads."""

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


class Int8Layout(NamedTuple):
    """Where a block of 32 values keeps its parts, for the products with int8-rounded activations
    (`pyml generate --activations q8_0`, pyml/package/quantized_dot.py's section "int8 activations")."""

    values_at: int  # the byte of its integers: 32 int8 values, or 16 bytes of nibbles
    four_bit: bool  # nibbles (value = q * d + offset) or int8 (value = q * d)
    offset_at: int | None  # the byte of a float16 offset m; None: -8 * d (for int8: unused)


# The block functions take and give 2-D arrays, one block per row: a quantizer (n, block_values)
# float32 -> (n, block_bytes) uint8, a dequantizer the reverse, in float32.
Blocks = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class WeightFormat:
    """One format: its block layout, its dequantization (llama.cpp's reference dequantizer, bit for
    bit), its quantizer where pyml writes it, and what the decode step reads it with."""

    ggml_type: GGMLType
    block_values: int  # values per block (a plain float type: 1)
    block_bytes: int
    dequantize: Blocks
    # blocks -> bytes as llama.cpp's reference quantizer writes them (a plain float type: the
    # float32 values -> the type's numpy array); None: pyml does not write the format
    quantize: Blocks | None = None
    # the decode step's loop over a row where the file stores it (pyml/package/quantized_dot.py):
    # row_values(builder, first_byte, values, use) hands use(weights, start) each float32 vector of
    # the dequantized row in order, weights holding values start ..; None: such a tensor becomes
    # float32 rows of its own when a step reads it
    row_values: Callable | None = None
    int8: Int8Layout | None = None  # a 32-value format's int8 products (`--activations q8_0`)
    # the arrays the CUDA decode step's kernels read (pyml/formats/gguf_quantized.py): blocks
    # (rows, blocks per row, block_bytes) -> its arrays, each (rows, ...); None: not kept quantized
    cuda_arrays: Callable | None = None

    @property
    def name(self) -> str:
        return self.ggml_type.name
