"""Weight rows read where they are stored (pyml/package/decode_cpu.py's `linear_stored` and
`embedding_stored`): each row by the address of its first byte, in the layout its file stores it.

- Every kind on small integers equals the exact model's matVec (pyml/exact.py) bit for bit, and on
  real weights gguf's dequantization times x within the float32 summation bound
  (tests/support/quantized_cases.py says why both).
- Kinds mixed within a layer and across layers, rows in any order; a sequence's result is the same
  bits alone as in a batch (for layers of one kind: tests/generate/test_quantized_decoding.py).
- A layer on int8 activations beside one read in place: each runs its own loop.
- The embedding's rows are pyml.formats.quant.dequantize's bits, times the scale.
- End to end on a GGUF written by gguf-py and memory-mapped by pyml.formats.gguf_read.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf.quants import quantize

from pyml import exact
from pyml.package.decode_cpu import (
    INT8_LAYER_KIND_OF,
    ROW_F64,
    dequantize_stored_rows,
    embedding_stored,
    linear_stored,
    row_addresses,
    stored_weight,
)
from tests.support.quantized_cases import (
    BLOCKS,
    assert_within_float32_sum,
    exact_weights,
    real_weights,
)
from pyml.weight_formats import FORMATS, GGMLType, dequantize

# every format the step reads where it is stored (each with a row loop), quantized ones first
QUANTIZED = tuple(GGML(int(t)) for t, f in FORMATS.items() if f.row_values is not None and f.block_values > 1)
FLOATS = tuple(GGML(int(t)) for t, f in FORMATS.items() if f.row_values is not None and f.block_values == 1)
KINDS = QUANTIZED + FLOATS
# Gemma 3's embedding scale, sqrt(640), rounded to float32 as the step is given it
GEMMA_SCALE = np.float32(25.298221281347036)


def values_per_block(ggml: GGML) -> int:
    return BLOCKS[ggml][0] if ggml in BLOCKS else 1


def float_bytes(values: np.ndarray, ggml: GGML) -> np.ndarray:
    """The little-endian bytes of `values` (rows, in) as F32, F16 or BF16 (bfloat16: the top half
    of each float32, so values that bfloat16 holds exactly are kept)."""
    if ggml == GGML.BF16:
        stored = (np.ascontiguousarray(values, "<f4").view("<u4") >> 16).astype("<u2")
    else:
        stored = values.astype("<f4" if ggml == GGML.F32 else "<f2")
    return np.ascontiguousarray(stored).view(np.uint8).reshape(-1)


def exact_rows(ggml: GGML, rows: int, columns: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, the integer matrix they encode) of small integers, for every kind."""
    if ggml in FLOATS:
        weights = rng.integers(-8, 9, (rows, columns))
        return float_bytes(weights.astype(np.float32), ggml), weights
    raw, weights = exact_weights(ggml, rows, columns, rng)
    return raw, weights


def real_rows(ggml: GGML, rows: int, columns: int, rng) -> np.ndarray:
    """Bytes of realistic weights of every kind (quantized_cases' real_weights; gguf's quantizer
    for Q5_0, the float kinds' rounding of normal values)."""
    if ggml in FLOATS:
        return float_bytes(rng.normal(0, 0.05, (rows, columns)).astype(np.float32), ggml)
    if ggml == GGML.Q5_0:
        return quantize(rng.normal(0, 0.05, (rows, columns)).astype(np.float32), ggml).reshape(-1)
    return real_weights(ggml, rows, columns, rng)


def decoded(raw: np.ndarray, ggml: GGML, rows: int, columns: int) -> np.ndarray:
    return dequantize(raw, GGMLType(int(ggml)), (rows, columns))


def one_layer(raw: np.ndarray, ggml: GGML, rows: int) -> tuple:
    """The stored form of one layer of `rows` rows of kind `ggml` in `raw` (the caller keeps it)."""
    return stored_weight(np.full((1, rows), int(ggml)), row_addresses(raw, rows)[None])


def run(weight: tuple, layer: int, x: np.ndarray) -> np.ndarray:
    y = np.full((x.shape[0], weight[0].shape[1]), np.nan, x.dtype)
    linear_stored(weight, layer, x, y)
    return y


def exact_mat_vecs(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.array([exact.mat_vec(weights.astype(np.int64).tolist(), row.tolist()) for row in x], np.float64)


@pytest.mark.parametrize("ggml", KINDS, ids=lambda t: t.name)
def test_each_kind_equals_the_exact_mat_vec(ggml):
    rng = np.random.default_rng(1)
    # two blocks a row; float rows of 83 values: 64, then 16, then 3 one by one; 37 rows: two whole
    # parts of 16 rows (the parallel loop's iterations) and part of a third
    rows, columns = 37, 2 * values_per_block(ggml) if ggml in BLOCKS else 83
    raw, weights = exact_rows(ggml, rows, columns, rng)
    assert np.array_equal(decoded(raw, ggml, rows, columns), weights)  # the encoder is right
    x = rng.integers(-8, 9, (5, columns))
    y = run(one_layer(raw, ggml, rows), 0, x.astype(np.float32))
    assert np.array_equal(y, exact_mat_vecs(weights, x))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ggml", KINDS, ids=lambda t: t.name)
def test_each_kinds_tiles_are_its_dequantized_rows(ggml, dtype):
    """A LoRA base's tiles (QLoRA's frozen maps): rows 3 .. 36 of 37, two whole parts of 16 and
    part of a third, are the format's dequantized rows, bit for bit (float64: converted exactly)."""
    rng = np.random.default_rng(3)
    rows, columns = 37, 512 if ggml in BLOCKS else 83
    raw = real_rows(ggml, rows, columns, rng)
    tile = np.full((rows - 3, columns), np.nan, dtype)
    dequantize_stored_rows(one_layer(raw, ggml, rows), 0, 3, tile)
    assert np.array_equal(tile, decoded(raw, ggml, rows, columns)[3:].astype(dtype))


@pytest.mark.parametrize("ggml", KINDS, ids=lambda t: t.name)
def test_each_kind_on_real_weights_is_the_dequantized_product(ggml):
    rng = np.random.default_rng(2)
    rows, columns = 6, 512 if ggml in BLOCKS else 200
    raw = real_rows(ggml, rows, columns, rng)
    x = rng.normal(0, 1, (5, columns)).astype(np.float32)
    y = run(one_layer(raw, ggml, rows), 0, x)
    assert_within_float32_sum(y, x, decoded(raw, ggml, rows, columns).astype(np.float64))


def mixed_layer(kinds, per_kind: int, columns: int, rng, exact_values: bool):
    """One layer of `per_kind` rows of each of `kinds`, in a shuffled order: (the byte arrays to
    keep, kinds, addresses, the matrix its rows stand for)."""
    kept, row_kinds, addresses, matrices = [], [], [], []
    for ggml in kinds:
        if exact_values:
            raw, weights = exact_rows(ggml, per_kind, columns, rng)
        else:
            raw = real_rows(ggml, per_kind, columns, rng)
            weights = decoded(raw, ggml, per_kind, columns).astype(np.float64)
        kept.append(raw)
        row_kinds += [int(ggml)] * per_kind
        addresses.append(row_addresses(raw, per_kind))
        matrices.append(weights)
    order = rng.permutation(len(row_kinds))
    addresses, matrix = np.concatenate(addresses)[order], np.concatenate(matrices)[order]
    assert np.any(np.diff(addresses.astype(np.int64)) < 0)  # not in the order of memory
    return kept, np.array(row_kinds)[order], addresses, matrix


def test_kinds_mixed_within_and_across_layers_in_any_row_order():
    """A layer of every kind's rows shuffled, and a second layer of Q4_K and Q6_K rows (a Q4_K_M
    file's) and F16 ones: each equals the exact matVec of its rows in their order."""
    rng = np.random.default_rng(4)
    columns = 512
    first = mixed_layer(KINDS, 3, columns, rng, exact_values=True)
    second = mixed_layer((GGML.Q4_K, GGML.Q6_K, GGML.F16), len(KINDS), columns, rng, exact_values=True)
    weight = stored_weight(np.stack([first[1], second[1]]), np.stack([first[2], second[2]]))
    x = rng.integers(-8, 9, (5, columns))
    for layer, (_, _, _, weights) in enumerate((first, second)):
        assert np.array_equal(run(weight, layer, x.astype(np.float32)), exact_mat_vecs(weights, x))


def test_a_sequence_gets_the_same_bits_alone_as_in_a_batch():
    rng = np.random.default_rng(5)
    columns = 512
    kept, kinds, addresses, weights = mixed_layer(KINDS, 2, columns, rng, exact_values=False)
    weight = stored_weight(kinds[None], addresses[None])
    x = rng.normal(0, 1, (5, columns)).astype(np.float32)
    together = run(weight, 0, x)
    assert_within_float32_sum(together, x, weights)
    for b in range(5):
        assert np.array_equal(run(weight, 0, x[b:b + 1]).view(np.int32), together[b:b + 1].view(np.int32))


def test_float64_rows_run_exactly_in_float64():
    rng = np.random.default_rng(6)
    rows, columns = 19, 70
    weights = rng.integers(-8, 9, (rows, columns))
    raw = np.ascontiguousarray(weights.astype("<f8")).view(np.uint8).reshape(-1)
    weight = stored_weight(np.full((1, rows), ROW_F64), row_addresses(raw, rows)[None])
    x = rng.integers(-8, 9, (5, columns))
    y = run(weight, 0, x.astype(np.float64))
    assert y.dtype == np.float64 and np.array_equal(y, exact_mat_vecs(weights, x))
    out = np.full((3, columns), np.nan)
    embedding_stored(weight, np.array([4, 0, 4]), out, np.float64(3.0))
    assert np.array_equal(out, weights[[4, 0, 4]] * 3.0)


@pytest.mark.parametrize("ggml", (GGML.Q8_0, GGML.Q4_0, GGML.Q4_1), ids=lambda t: t.name)
def test_int8_activation_layers_beside_layers_read_in_place(ggml):
    """A layer on int8 activations (37 rows: two whole groups of 16 and one of 5) gives gguf's
    dequantization times the rounded activations (tests/generate/test_quantized_decoding.py has
    it exactly), for 1 to 13 sequences (8, 4 and 1 at a time), each sequence's bits its own; its
    rows keep their kinds and addresses, and the other layer, on float activations, is as it was."""
    from pyml.generate.stored_step import with_int8_activations

    rng = np.random.default_rng(7)
    rows, columns = 37, 256
    raw, other = real_rows(ggml, rows, columns, rng), real_rows(GGML.Q6_K, rows, columns, rng)
    in_place = stored_weight(
        np.stack([np.full(rows, int(ggml)), np.full(rows, int(GGML.Q6_K))]),
        np.stack([row_addresses(raw, rows), row_addresses(other, rows)]))
    stored = with_int8_activations(in_place)
    assert stored[2].tolist() == [INT8_LAYER_KIND_OF[int(ggml)], int(GGML.Q6_K)]
    assert stored[0] is in_place[0] and stored[1] is in_place[1]
    weights = decoded(raw, ggml, rows, columns).astype(np.float64)
    for batch in (1, 4, 5, 13):
        x = rng.normal(0, 1, (batch, columns)).astype(np.float32)
        together = run(stored, 0, x)
        # the rounding's error: a relative 1/254 of each block's largest activation
        reference = x.astype(np.float64) @ weights.T
        assert np.all(np.abs(together - reference) <= 0.01 * (np.abs(x) @ np.abs(weights).T))
        for b in range(batch):
            assert np.array_equal(run(stored, 0, x[b:b + 1]).view(np.int32), together[b:b + 1].view(np.int32))
    x = rng.normal(0, 1, (3, columns)).astype(np.float32)
    assert np.array_equal(run(stored, 1, x), run(one_layer(other, GGML.Q6_K, rows), 0, x))


@pytest.mark.parametrize("ggml", KINDS, ids=lambda t: t.name)
def test_embedding_rows_are_dequantizes_bits_times_the_scale(ggml):
    rng = np.random.default_rng(8)
    rows, columns = 7, 512 if ggml in BLOCKS else 83
    raw = real_rows(ggml, rows, columns, rng)
    table = decoded(raw, ggml, rows, columns)
    ids = np.array([3, 0, 6, 3, 1])
    for scale in (np.float32(1.0), GEMMA_SCALE):
        out = np.full((len(ids), columns), np.nan, np.float32)
        embedding_stored(one_layer(raw, ggml, rows), ids, out, scale)
        assert np.array_equal(out.view(np.int32), (table[ids] * scale).view(np.int32))


def test_an_embedding_refuses_ids_outside_its_table():
    raw = real_rows(GGML.Q8_0, 4, 32, np.random.default_rng(9))
    weight, out = one_layer(raw, GGML.Q8_0, 4), np.zeros((1, 32), np.float32)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="token id out of range of the embedding table"):
            embedding_stored(weight, np.array([bad]), out, np.float32(1.0))


def test_the_stored_form_refuses_what_it_cannot_read():
    layer_kind = INT8_LAYER_KIND_OF[GGMLType.Q8_0]  # a layer's kind, no row's
    with pytest.raises(ValueError, match=rf"row kinds \[{layer_kind}\] are not read where they are stored"):
        stored_weight(np.full((1, 2), layer_kind), np.zeros((1, 2), np.uint64))
    with pytest.raises(ValueError, match="one \\(layers, rows\\) shape"):
        stored_weight(np.zeros((1, 2)), np.zeros((2, 1), np.uint64))


def test_rows_read_in_place_from_a_memory_mapped_gguf(tmp_path):
    """A GGUF written by gguf-py (Q4_K rows that gguf cannot quantize, stored as raw bytes; Q8_0;
    BF16), read by pyml.formats.gguf_read, whose tensor data are views of the file's memory map:
    the step reads each row there."""
    import gguf

    from pyml.formats.gguf_read import read_gguf

    rng = np.random.default_rng(10)
    rows, columns = 12, 256
    written = {"q4_k": (GGML.Q4_K, real_rows(GGML.Q4_K, rows, columns, rng)),
               "q8_0": (GGML.Q8_0, real_rows(GGML.Q8_0, rows, columns, rng)),
               "bf16": (GGML.BF16, real_rows(GGML.BF16, rows, columns, rng))}
    path = tmp_path / "rows.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name, (ggml, raw) in written.items():
        writer.add_tensor(name, raw, raw_shape=(rows, raw.size // rows), raw_dtype=ggml)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = read_gguf(path).tensors
    x = rng.normal(0, 1, (4, columns)).astype(np.float32)
    for name, (ggml, raw) in written.items():
        tensor = tensors[name]
        assert tensor.shape == (rows, columns) and not tensor.data.flags.owndata
        weight = one_layer(tensor.data, ggml, rows)
        assert np.array_equal(np.asarray(tensor.data), raw)  # the rows at those addresses are the file's
        y = run(weight, 0, x)
        assert_within_float32_sum(y, x, decoded(raw, ggml, rows, columns).astype(np.float64))
        out = np.zeros((2, columns), np.float32)
        embedding_stored(weight, np.array([11, 2]), out, np.float32(1.0))
        assert np.array_equal(out.view(np.int32), decoded(raw, ggml, rows, columns)[[11, 2]].view(np.int32))
