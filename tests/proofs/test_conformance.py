"""Exact-model conformance of the CPU kernels (layer 3 of "Correctness, in layers", DESIGN.md).

Every kernel of a linear map runs on small-integer float64 inputs, where float arithmetic is exact,
and must equal the Python mirror of the Lean exact model (`pyml/exact.py`) exactly. The case logic
is in tests/support/conformance_cases.py, shared with the CUDA kernels (tests/cuda/conformance_cuda_cases.py,
run under Numba's CUDA simulator by tests/cuda/test_cuda_sim.py). Seed 0 draws every free
size as 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyml.package.bf16_products import has_bf16_products

from tests.support.conformance_cases import (
    CONFIGS,
    CPU,
    STORED_ROW_TYPES,
    case_attention_backward,
    case_attention_forward_one_token,
    case_embedding,
    case_frozen_linear,
    case_frozen_linear_stored,
    case_linear,
    case_linear_bf16,
    case_linear_bf16_long_k,
    case_relu_backward,
    case_residual,
    case_rope,
)

SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(seed, bias):
    """linear forward == matMul X (transpose W) (+ vecAdd b per row); backward dX == matMul G W
    (Lean law linear_weight_adjoint_input), dW == matMul (transpose G) X (law
    linear_weight_adjoint_weight), db == matMul (transpose 1) G, the column sums (law
    matmul_adjoint_right for the bias term 1 bᵀ)."""
    case_linear(CPU, seed, bias)


@pytest.mark.skipif(not has_bf16_products(), reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16(seed, bias):
    """the bf16 linear kernels (`--precision bf16`) == the exact matMul of the operands rounded to
    bfloat16 as the mirror rounds them (exact.round_bf16); db the column sums, unrounded."""
    case_linear_bf16(seed, bias)


@pytest.mark.skipif(not has_bf16_products(), reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("seed", range(2))
def test_linear_bf16_over_blocks_of_k(seed):
    """the bf16 products over a k of several blocks, odd: the exact matMul of the rounded operands."""
    case_linear_bf16_long_k(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_frozen_linear_with_lora_adapters(seed):
    """a frozen linear map with LoRA adapters: forward == X Wᵀ plus, per adapter, smul 2 of
    matMul (matMul X Aᵀ) Bᵀ (compose_adjoint's chain); dX == G W + dH A, dA == dHᵀ X, dB == 2 Gᵀ H
    (laws linear_weight_adjoint_input and _weight, smul_adjoint); no gradient of W."""
    case_frozen_linear(CPU, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("scaled", [False, True])
def test_embedding(config, seed, scaled):
    """embedding forward == gather E ids; backward == scatterAdd G ids (on a zeroed dtable, with
    repeated ids) and vecAdd of it onto a non-zero dtable (Lean law embedding_adjoint). Scaled by
    an integer s (Gemma's scale): forward == hadamard (s 1) (gather E ids), backward ==
    scatterAdd (hadamard (s 1) G) ids (laws hadamard_adjoint and embedding_adjoint, composed)."""
    case_embedding(CPU, config, seed, scaled)


@pytest.mark.parametrize("seed", SEEDS)
def test_relu_backward(seed):
    """relu backward == hadamard dy (relu' x) per row (Lean law hadamard_adjoint). The SwiGLU's
    product is not tested here: it multiplies by silu(g), which is not exact in floats."""
    case_relu_backward(CPU, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_residual(seed):
    """residual forward == vecAdd x r per row; backward dx + dout == vecAdd dx dout, the fan-out
    (Lean law residual_adjoint)."""
    case_residual(CPU, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_rope(config, seed):
    """rope forward with integer cos/sin tables == rotate c s x1 x2 per (b, t, h) at each token's
    position in its packed example; backward == rotateT c s g1 g2 there (Lean law
    rotation_adjoint); decode == rotate at one position."""
    case_rope(CPU, config, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("window", "packed"), [(0, False), (2, False), (3, False), (0, True), (3, True)])
def test_attention_backward(config, seed, window, packed):
    """attention backward with causal att of dyadic probabilities (multiples of 1/8, some rows
    one-hot): for O = P V, dP == matMul G (transpose V) (Lean law matmul_adjoint_left) and
    dV == Σ_group matMul (transpose P) G (matmul_adjoint_right); dS = hadamard P (dP - rowsum), the
    softmax backward (no Lean law, exact here); for S = scale Q Kᵀ, dQ == scale matMul dS K
    (matmul_adjoint_left) and dK == Σ_group scale matMul (transpose dS) Q (matmul_adjoint_right).
    The scale is 1/sqrt(head_dim) or another power of two; with a sliding window (2, 3) P is zero
    outside it and the backward is given the window; packed rows hold several examples, P is zero
    across them and the backward is given each token's position in its example."""
    case_attention_backward(CPU, config, seed, window, packed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_attention_forward_one_token(config, seed):
    """attention forward and decode with one token: P == [[1]] and O == matMul P V_g (Lean
    definition matMul, the product whose adjoints are matmul_adjoint_left/right)."""
    case_attention_forward_one_token(CPU, config, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kinds", [(kind,) for kind in STORED_ROW_TYPES] + [STORED_ROW_TYPES])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_frozen_linear_on_stored_rows(seed, kinds, dtype, monkeypatch):
    """a frozen linear map whose rows are read where a GGUF stores them (QLoRA): forward ==
    matMul X (transpose W) and dX == matMul G W (law linear_weight_adjoint_input), W the matrix of
    the rows' dequantized values, per row type and for a layer of mixed rows; tiles of 16 rows, so
    that a map of up to 40 rows takes several."""
    monkeypatch.setattr("pyml.package.cpu.frozen_linear.TILE_VALUES", 1)
    case_frozen_linear_stored(seed, kinds, dtype)
