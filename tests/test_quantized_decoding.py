"""The generated fused decode step (gen/<name>/decode_cpu.py) and its linear maps.

- `linear_row`, the step's linear map, equals the exact model's matVec (pyml/exact.py) bit for bit
  in every format it runs, and on layers of two formats in one stack, on small integers where
  float32 arithmetic is exact (tests/quantized_cases.py says why).
- The whole step on llama_tiny with weights quantized to Q8_0, Q4_0 or Q4_1 gives, position after
  position, the logits of a float64 numpy forward over the whole sequence on the same (dequantized)
  weights, within float32 rounding.
The real SmolLM2 through it (its greedy tokens equal to the float32 path's) is in test_generate.py.
"""

from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from quantized_cases import TYPES, exact_weights, gguf_weights

from gen.llama_tiny import model as tiny
from pyml import exact
from pyml.errors import PymlError
from pyml.package.decode_cpu import DENSE, linear_row
from pyml.runtime.gguf_quantized import BLOCKS, quantized_matrix
from pyml.runtime.quant import GGMLType
from pyml.runtime.quantized_decoding import (
    STEP_KINDS,
    QuantizedDecoder,
    check_weights,
    kept_arrays,
    weight_tuple,
)
from pyml.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


STEP_TYPES = (*TYPES, GGML.Q5_0)  # Q5_0: the fused step's only (Gemma 3's q, k, v, gate, up)


@pytest.mark.parametrize("ggml", [*STEP_TYPES, None], ids=[t.name for t in STEP_TYPES] + ["dense"])
def test_linear_row_equals_the_exact_mat_vec(ggml):
    rng = np.random.default_rng(3)
    rows, columns = 5, 2 * (BLOCKS[ggml][0] if ggml else 32)
    if ggml is None:
        weights = rng.integers(-8, 9, (rows, columns))
        weight = weight_tuple([DENSE], [{"dense": weights.astype(np.float32)}], rows)
    else:
        raw, weights = exact_weights(ggml, rows, columns, rng)
        assert np.array_equal(gguf_weights(raw, ggml, rows, columns), weights)  # the encoder is right
        ggml_type = GGMLType(int(ggml))
        arrays = quantized_matrix(raw, ggml, (rows, columns)).arrays
        weight = weight_tuple([STEP_KINDS[ggml_type]], [kept_arrays(ggml_type, arrays)], rows)
    x = rng.integers(-8, 9, (1, columns))
    y = np.full((1, rows), np.nan, np.float32)
    linear_row(weight, 0, x.astype(np.float32), y)
    expected = exact.mat_vec(weights.astype(np.int64).tolist(), x[0].tolist())
    assert np.array_equal(y[0], np.array(expected, dtype=np.float64))


def test_layers_of_two_kinds_share_one_stack():
    """Q4_K and Q6_K layers of one op (a Q4_K_M file's ffn_down), each array padded to its widest
    layer: every layer still equals its exact matVec."""
    rng = np.random.default_rng(4)
    rows, columns = 3, 512
    layers, matrices, kinds = [], [], []
    for ggml in (GGML.Q4_K, GGML.Q6_K, GGML.Q4_K):
        raw, weights = exact_weights(ggml, rows, columns, rng)
        ggml_type = GGMLType(int(ggml))
        layers.append(kept_arrays(ggml_type, quantized_matrix(raw, ggml, (rows, columns)).arrays))
        matrices.append(weights)
        kinds.append(STEP_KINDS[ggml_type])
    weight = weight_tuple(kinds, layers, rows)
    x = rng.integers(-8, 9, (1, columns))
    for layer, weights in enumerate(matrices):
        y = np.full((1, rows), np.nan, np.float32)
        linear_row(weight, layer, x.astype(np.float32), y)
        expected = exact.mat_vec(weights.astype(np.int64).tolist(), x[0].tolist())
        assert np.array_equal(y[0], np.array(expected, dtype=np.float64))


def reference_logits(params, ids: list[int]) -> np.ndarray:
    """llama_tiny's logits (T, VOCAB) at every position, in float64 numpy, read off its spec."""
    spec = load_spec(ROOT / "specs" / "llama_tiny.toml")
    attention = spec.attentions()[0]
    H, KV, D = attention.n_heads, attention.n_kv_heads, attention.head_dim
    T, f = len(ids), (lambda array: np.asarray(array, np.float64))
    angles = np.arange(T)[:, None] / attention.rope.theta ** (np.arange(0, D, 2) / D)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.final_norm.eps) * f(w)

    def rope(h):  # (T, heads, D): the halves (i, i + D / 2) rotated together
        first, second = h[..., :D // 2], h[..., D // 2:]
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)

    x = f(params.embed)[ids]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(tiny.N_LAYERS):
        qkv = norm(x, params.input_layernorm[l]) @ f(params.self_attn_qkv[l]).T
        q = rope(qkv[:, :H * D].reshape(T, H, D))
        k = np.repeat(rope(qkv[:, H * D:(H + KV) * D].reshape(T, KV, D)), H // KV, axis=1)
        v = np.repeat(qkv[:, (H + KV) * D:].reshape(T, KV, D), H // KV, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(T, H * D) @ f(params.self_attn_o[l]).T
        gate_up = norm(x, params.post_attention_layernorm[l]) @ f(params.mlp_gate_up[l]).T
        gate, up = np.split(gate_up, 2, axis=1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f(params.mlp_down[l]).T
    return norm(x, params.final_norm) @ f(params.embed).T


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "q4_1"])
def test_fused_step_logits_equal_a_numpy_forward(weights):
    rng = np.random.default_rng(0)
    model = tiny.Model()
    model.params.flat[:] = rng.normal(0, 0.3, model.params.flat.shape)
    decoder = QuantizedDecoder.load(model, weights, gguf_path=None)  # the float32 weights now dequantized
    ids = rng.integers(0, tiny.VOCAB, 12).tolist()
    expected = reference_logits(model.params, ids)
    cache, logits = decoder.start_decoding(np.array([ids[:5]]), len(ids))
    scale = np.abs(expected).max()
    threads = numba.get_num_threads()
    for position in range(5, len(ids)):
        logits = decoder.decode(cache, np.array([ids[position]]))
        assert np.abs(logits[0] - expected[position]).max() < 1e-5 * scale
    # the step runs its small ops on one of the pool's threads, and gives the count back
    assert numba.get_num_threads() == threads


def test_weights_the_fused_step_does_not_know_are_refused_in_one_line():
    with pytest.raises(PymlError, match="--weights must be one of as-stored, f32, q8_0, q4_0, q4_1, not 'Q4_1'"):
        check_weights("Q4_1")
