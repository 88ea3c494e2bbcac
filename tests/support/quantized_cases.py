"""GGUF blocks of exact and real weights for the decode steps' linear maps, shared by the CPU tests
(tests/kernels/test_stored_rows.py, tests/generate/test_quantized_decoding.py,
tests/kernels/test_gguf_quantized.py), and the CUDA step's cases on its split arrays under Numba's
simulator (tests/cuda/quantized_decode_cuda_cases.py).

Two kinds of weights, each encoded as the GGUF bytes of its type and loaded through
`pyml.formats.gguf_quantized`, so the layout decoding is under test too:
- exact: small integers q with small integer scales and offsets (float16 represents them exactly),
  so every weight, product and partial sum is an integer far below 2^24 and float32 arithmetic is
  exact in any order. `gguf.quants.dequantize` of the bytes must give back exactly the integer
  matrix the case meant (that checks the encoder against gguf), and the linear map must equal the
  exact model's `matVec` (`pyml/exact.py`, the Python mirror of the Lean definition) on it.
- real: the rounding of actual weights (gguf's own quantizer for the 32-value types; random packed
  bytes and realistic float16 scales for the K-quants, which gguf cannot quantize), compared with
  gguf's dequantization times x within the worst-case float32 summation bound.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize

from pyml import exact
from pyml.formats.gguf_quantized import quantized_matrix
from pyml.weight_formats import FORMATS, GGMLType
from pyml.generate.cuda_weights import STEP_KINDS, kept_arrays, weight_tuple
from pyml.package.decode_cuda import DENSE

# values and bytes per block of each quantized type the CPU reads as stored
BLOCKS = {GGML(int(ggml_type)): (format.block_values, format.block_bytes) for ggml_type, format in FORMATS.items()
          if format.row_values is not None and format.block_values > 1}

TYPES = (GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q4_K, GGML.Q6_K)  # the types of the shipped GGUFs
# float32 unit roundoff: a sum of K products is within K * UNIT * sum |w x| of the exact one
UNIT = 2.0**-24


def half_bytes(values: np.ndarray) -> np.ndarray:
    """float16 bytes of `values` (..., n) as uint8 (..., 2 n)."""
    return np.ascontiguousarray(values.astype("<f2")).view(np.uint8)


def nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low.astype(np.uint8) | (high.astype(np.uint8) << np.uint8(4))).astype(np.uint8)


def encode(ggml: GGML, q: np.ndarray, d: np.ndarray, second: np.ndarray | None = None,
           sub_scales: np.ndarray | None = None) -> np.ndarray:
    """GGUF bytes of a matrix of stored integers `q` (rows, in), per-block float16 `d` (rows,
    blocks), Q4_1's m or Q4_K's dmin as `second`, and the K-quants' integer sub-block scales:
    Q4_K's (scales, mins), each (rows, blocks, 8), or Q6_K's int8 (rows, blocks, 16)."""
    rows, columns = q.shape
    per_block, size = BLOCKS[ggml]
    n_blocks = columns // per_block
    q = q.reshape(rows, n_blocks, per_block)
    out = np.zeros((rows, n_blocks, size), np.uint8)
    if ggml == GGML.Q8_0:
        out[..., :2], out[..., 2:] = half_bytes(d[..., None]), q.astype(np.int8).view(np.uint8)
    elif ggml in (GGML.Q4_0, GGML.Q4_1):
        start = 2 if ggml == GGML.Q4_0 else 4
        out[..., :2] = half_bytes(d[..., None])
        if ggml == GGML.Q4_1:
            out[..., 2:4] = half_bytes(second[..., None])
        out[..., start:] = nibbles(q[..., :16], q[..., 16:])
    elif ggml == GGML.Q5_0:  # d, then qh: bit j of a little-endian uint32 is value j's fifth bit
        out[..., :2] = half_bytes(d[..., None])
        fifth = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        out[..., 2:6] = np.ascontiguousarray(fifth.sum(-1, dtype=np.uint32)[..., None]).view(np.uint8)
        out[..., 6:] = nibbles(q[..., :16] & 15, q[..., 16:] & 15)
    elif ggml in (GGML.Q4_K, GGML.Q5_K):
        scales, mins = sub_scales
        out[..., :2], out[..., 2:4] = half_bytes(d[..., None]), half_bytes(second[..., None])
        out[..., 4:8] = scales[..., :4] | ((scales[..., 4:] >> 4) << 6)
        out[..., 8:12] = mins[..., :4] | ((mins[..., 4:] >> 4) << 6)
        out[..., 12:16] = nibbles(scales[..., 4:] & 15, mins[..., 4:] & 15)
        runs = q.reshape(rows, n_blocks, 4, 64)  # a run of 32 bytes holds 64 values
        start = 16
        if ggml == GGML.Q5_K:  # value 64 r + 32 h + i's fifth bit: bit 2 r + h of byte i
            halves = (runs >> 4).reshape(rows, n_blocks, 8, 32).astype(np.uint8)
            out[..., 16:48] = sum(halves[..., k, :] << np.uint8(k) for k in range(8)).astype(np.uint8)
            start = 48
        out[..., start:] = nibbles(runs[..., :32] & 15, runs[..., 32:] & 15).reshape(rows, n_blocks, 128)
    elif ggml == GGML.Q6_K:
        halves = q.reshape(rows, n_blocks, 2, 128)
        low = nibbles(halves[..., :64] & 15, halves[..., 64:] & 15)
        fields = (halves >> 4).reshape(rows, n_blocks, 2, 4, 32).astype(np.uint8)
        high = sum(fields[..., k, :] << np.uint8(2 * k) for k in range(4)).astype(np.uint8)
        out[..., :128] = low.reshape(rows, n_blocks, 128)
        out[..., 128:192] = high.reshape(rows, n_blocks, 64)
        out[..., 192:208] = sub_scales.astype(np.int8).view(np.uint8)
        out[..., 208:] = half_bytes(d[..., None])
    return out.reshape(-1)


def exact_weights(ggml: GGML, rows: int, columns: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF bytes, the integer weight matrix they encode) with small integer scales."""
    n_blocks = columns // BLOCKS[ggml][0]
    d = rng.integers(1, 3, (rows, n_blocks)).astype(np.float32)
    if ggml == GGML.Q8_0:
        q = rng.integers(-128, 128, (rows, columns))
        weights = q * np.repeat(d, 32, axis=1)
        return encode(ggml, q, d), weights
    if ggml == GGML.Q4_0:
        q = rng.integers(0, 16, (rows, columns))
        return encode(ggml, q, d), (q - 8) * np.repeat(d, 32, axis=1)
    if ggml == GGML.Q5_0:
        q = rng.integers(0, 32, (rows, columns))
        return encode(ggml, q, d), (q - 16) * np.repeat(d, 32, axis=1)
    if ggml == GGML.Q4_1:
        m = rng.integers(-3, 4, (rows, n_blocks)).astype(np.float32)
        q = rng.integers(0, 16, (rows, columns))
        return encode(ggml, q, d, m), q * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
    if ggml in (GGML.Q4_K, GGML.Q5_K):
        dmin = rng.integers(0, 3, (rows, n_blocks)).astype(np.float32)
        scales = rng.integers(0, 64, (rows, n_blocks, 8)).astype(np.uint8)  # all six bits
        mins = rng.integers(0, 64, (rows, n_blocks, 8)).astype(np.uint8)
        q = rng.integers(0, 16 if ggml == GGML.Q4_K else 32, (rows, columns))
        scale = np.repeat((d[..., None] * scales).reshape(rows, -1), 32, axis=1)
        offset = np.repeat((dmin[..., None] * mins).reshape(rows, -1), 32, axis=1)
        return encode(ggml, q, d, dmin, (scales, mins)), q * scale - offset
    scales = rng.integers(-15, 16, (rows, n_blocks, 16))  # Q6_K
    q = rng.integers(0, 64, (rows, columns))
    scale = np.repeat((d[..., None] * scales).reshape(rows, -1), 16, axis=1)
    return encode(ggml, q, d, sub_scales=scales), (q - 32) * scale


def real_weights(ggml: GGML, rows: int, columns: int, rng) -> np.ndarray:
    """GGUF bytes of realistic weights: gguf's quantizer of normal values for the 32-value types;
    random packed bytes and random scales of the usual size for the K-quants."""
    if ggml in (GGML.Q8_0, GGML.Q4_0, GGML.Q4_1):
        return quantize(rng.normal(0, 0.05, (rows, columns)).astype(np.float32), ggml).reshape(-1)
    per_block, size = BLOCKS[ggml]
    raw = rng.integers(0, 256, (rows, columns // per_block, size), dtype=np.uint8)
    if ggml in (GGML.Q4_K, GGML.Q5_K):
        raw[..., :4] = half_bytes(rng.uniform(1e-4, 3e-3, raw.shape[:2] + (2,)))
    else:
        raw[..., 208:] = half_bytes(rng.uniform(1e-4, 3e-3, raw.shape[:2] + (1,)))
    return raw.reshape(-1)


def gguf_weights(raw: np.ndarray, ggml: GGML, rows: int, columns: int) -> np.ndarray:
    return dequantize(raw, ggml).reshape(rows, columns)


def assert_within_float32_sum(y: np.ndarray, x: np.ndarray, weights: np.ndarray) -> None:
    """y is x @ weights.T up to float32 rounding of a sum of in_features products."""
    reference = x.astype(np.float64) @ weights.T
    # each product rounds once, and a sum of n terms in any order is within (n - 1) u of exact
    bound = (weights.shape[1] + 1) * UNIT * (np.abs(x).astype(np.float64) @ np.abs(weights).T)
    assert np.all(np.abs(y - reference) <= bound), np.max(np.abs(y - reference) / bound)


# -- the CUDA step's linear map (pyml/package/decode_cuda.py) -----------------------------------------
# `run_step(weight, layer, x)` runs its linear_row on a split weight tuple (host arrays,
# pyml.generate.cuda_weights.weight_tuple) and returns y (1, rows) on the host. (The CPU step's
# stored rows have the same cases in tests/kernels/test_stored_rows.py.)

STEP_TYPES = (*TYPES, GGML.Q5_0)  # Q5_0: the fused steps' only (Gemma 3's q, k, v, gate, up)


def step_weight(raw: np.ndarray, ggml: GGML, rows: int, columns: int) -> tuple:
    """The step's weight tuple of one layer: GGUF bytes `raw` of type `ggml`."""
    ggml_type = GGMLType(int(ggml))
    arrays = kept_arrays(ggml_type, quantized_matrix(raw, ggml, (rows, columns)).arrays)
    return weight_tuple([STEP_KINDS[ggml_type]], [arrays], rows)


def step_layer(ggml: GGML, rows: int, columns: int, rng) -> tuple[int, dict, np.ndarray]:
    """(the step's kind, its arrays, the integer matrix) of an exact layer of type `ggml`, or of
    small-integer dense rows for None."""
    if ggml is None:
        weights = rng.integers(-8, 9, (rows, columns))
        return DENSE, {"dense": weights.astype(np.float32)}, weights
    raw, weights = exact_weights(ggml, rows, columns, rng)
    assert np.array_equal(gguf_weights(raw, ggml, rows, columns), weights)  # the encoder is right
    ggml_type = GGMLType(int(ggml))
    arrays = kept_arrays(ggml_type, quantized_matrix(raw, ggml, (rows, columns)).arrays)
    return STEP_KINDS[ggml_type], arrays, weights


def assert_step_equals_the_exact_mat_vec(run_step, weight, layer, weights, x) -> None:
    y = run_step(weight, layer, x.astype(weight[5].dtype if weight[5].size else np.float32))
    expected = exact.mat_vec(weights.astype(np.int64).tolist(), x[0].tolist())
    assert np.array_equal(y[0], np.array(expected, dtype=np.float64))


def case_step_exact(run_step, ggml: GGML | None) -> None:
    """One layer of `ggml` (None: dense rows) equals the exact model's matVec bit for bit."""
    rng = np.random.default_rng(3)
    rows, columns = 5, 2 * (BLOCKS[ggml][0] if ggml else 32)
    kind, arrays, weights = step_layer(ggml, rows, columns, rng)
    weight = weight_tuple([kind], [arrays], rows)
    assert_step_equals_the_exact_mat_vec(run_step, weight, 0, weights, rng.integers(-8, 9, (1, columns)))


def case_step_two_kinds_in_one_stack(run_step) -> None:
    """Q4_K and Q6_K layers of one op (a Q4_K_M file's ffn_down), each array padded to its widest
    layer: every layer still equals its exact matVec."""
    rng = np.random.default_rng(4)
    rows, columns = 3, 512
    layers = [step_layer(ggml, rows, columns, rng) for ggml in (GGML.Q4_K, GGML.Q6_K, GGML.Q4_K)]
    weight = weight_tuple([kind for kind, _, _ in layers], [arrays for _, arrays, _ in layers], rows)
    x = rng.integers(-8, 9, (1, columns))
    for layer, (_, _, weights) in enumerate(layers):
        assert_step_equals_the_exact_mat_vec(run_step, weight, layer, weights, x)


def case_step_float64_rows(run_step) -> None:
    """A float64 model's dense rows (the fuzz corpus' specs) run in float64, exactly."""
    from pyml.package.decode_cuda import DENSE
    rng = np.random.default_rng(8)
    weights = rng.integers(-8, 9, (19, 64))
    weight = weight_tuple([DENSE], [{"dense": weights.astype(np.float64)}], 19)
    assert_step_equals_the_exact_mat_vec(run_step, weight, 0, weights, rng.integers(-8, 9, (1, 64)))
