"""Quantized weights kept as the GGUF stores them (pyml/formats/gguf_quantized.py).

- The layout: the weights its arrays imply are gguf's dequantization bit for bit, for every kept
  type, on real and random blocks.
- Real weights: SmolLM2's own Q4_1 and Q8_0 matrices through the decode step's linear map equal
  gguf's dequantization times x within the float32 rounding of the sum (the exact and int8 cases
  are tests/generate/test_quantized_decoding.py's).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML

from pyml.errors import PymlError
from pyml.formats.gguf_quantized import quantized_matrix
from pyml.package.decode_cpu import linear_stored, row_addresses, stored_weight
from tests.support.quantized_cases import (
    BLOCKS,
    TYPES,
    assert_within_float32_sum,
    exact_weights,
    gguf_weights,
    real_weights,
)


def implied_weights(matrix) -> np.ndarray:
    """The float32 weights the layout's arrays stand for, decoded here independently of the
    kernels: q * scale + offset per value, the nibbles unpacked from their runs."""
    rows, columns = matrix.shape
    if matrix.ggml_type == GGML.Q8_0:
        values, scale = matrix.arrays
        return values.astype(np.float32) * np.repeat(scale, 32, axis=1)
    if matrix.ggml_type == GGML.Q6_K:
        low, high, scale = matrix.arrays
        low = low.reshape(rows, -1, 64)
        high = high.reshape(rows, -1, 32)
        nibble = np.concatenate([low & 15, low >> 4], axis=2)  # values 0..127 of each group
        high_bits = np.concatenate([(high >> (2 * k)) & 3 for k in range(4)], axis=2)
        q = (nibble | (high_bits << 4)).astype(np.float32) - np.float32(32)
        return q.reshape(rows, columns) * np.repeat(scale, 16, axis=1)
    values, scale, offset = matrix.arrays
    run = 32 if matrix.ggml_type == GGML.Q4_K else 16
    runs = values.reshape(rows, -1, run)
    q = np.concatenate([runs & 15, runs >> 4], axis=2).reshape(rows, columns).astype(np.float32)
    return q * np.repeat(scale, 32, axis=1) + np.repeat(offset, 32, axis=1)


@pytest.mark.parametrize("ggml", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["exact", "real"])
def test_layout_stands_for_ggufs_weights_bit_for_bit(ggml, kind):
    rng = np.random.default_rng(1)
    rows, columns = 6, BLOCKS[ggml][0] * 2
    raw = (exact_weights(ggml, rows, columns, rng)[0] if kind == "exact"
           else real_weights(ggml, rows, columns, rng))
    matrix = quantized_matrix(raw, ggml, (rows, columns))
    assert all(array.flags.c_contiguous and array.shape[0] == rows for array in matrix.arrays)
    expected = gguf_weights(raw, ggml, rows, columns)
    assert np.array_equal(implied_weights(matrix), expected)
    # the packed integers are the file's bytes: no more than 4 bytes per scale are added
    assert matrix.nbytes <= raw.size + 8 * rows * columns // 32


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.29.ffn_down.weight",
                                  "blk.7.ffn_gate.weight", "token_embd.weight"])
def test_smollm2_weights(name):
    """The shipped SmolLM2 GGUF's matrices (Q4_1; the tied embedding Q8_0, its first 4096 rows)."""
    from pyml.formats.gguf_read import read_gguf
    from pyml.formats.smollm2_gguf import shipped_gguf_path

    tensor = read_gguf(shipped_gguf_path()).tensors[name]
    rows, columns = min(tensor.shape[0], 4096), tensor.shape[1]
    ggml = GGML(int(tensor.ggml_type))
    raw = np.array(tensor.data[: rows * columns // BLOCKS[ggml][0] * BLOCKS[ggml][1]])
    x = np.random.default_rng(0).normal(0, 1, (3, columns)).astype(np.float32)
    weight = stored_weight(np.full((1, rows), int(ggml)), row_addresses(raw, rows)[None])
    y = np.zeros((3, rows), np.float32)
    for n in range(3):
        linear_stored(weight, 0, x[n : n + 1], y[n : n + 1])
    assert_within_float32_sum(y, x, gguf_weights(raw, ggml, rows, columns).astype(np.float64))


def test_rows_reorders_every_array():
    rng = np.random.default_rng(2)
    raw = real_weights(GGML.Q4_K, 5, 256, rng)
    matrix = quantized_matrix(raw, GGML.Q4_K, (5, 256))
    order = np.array([3, 0, 4, 1, 2])
    assert np.array_equal(implied_weights(matrix.rows(order)), implied_weights(matrix)[order])


def test_what_cannot_be_kept_quantized_is_one_clear_error():
    raw = np.zeros(34 * 4, np.uint8)
    with pytest.raises(PymlError, match="F32 weights cannot be kept quantized"):
        quantized_matrix(raw, GGML.F32, (4, 32))
    with pytest.raises(PymlError, match="needs 136 bytes"):
        quantized_matrix(raw[:-1], GGML.Q8_0, (4, 32))
    with pytest.raises(PymlError, match="not whole Q4_K blocks of 256"):
        quantized_matrix(raw, GGML.Q4_K, (1, 32))
