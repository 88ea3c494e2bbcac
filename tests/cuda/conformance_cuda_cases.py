"""Exact-model conformance of the CUDA kernels, under Numba's CUDA simulator or on a GPU (the switch
of tests/support/cuda_target.py).

The same cases as tests/proofs/test_conformance.py (the logic is in tests/support/conformance_cases.py), with
arrays moved to the device and back. Not collected directly (the name does not start with test_):
tests/cuda/test_cuda_sim.py runs this file in a child pytest process, because NUMBA_ENABLE_CUDASIM
only takes effect if it is set before numba.cuda is first imported, and pytest imports every test
module of a session before running any. Fewer seeds than on the CPU: the simulator runs each thread
as a Python thread.
"""

from __future__ import annotations

# isort: off
from tests.support.cuda_target import check_target  # first: sets the target
# isort: on

import pytest
from numba import cuda

from tests.support.conformance_cases import (
    CONFIGS,
    Target,
    case_attention_backward,
    case_attention_forward_one_token,
    case_embedding,
    case_frozen_linear,
    case_linear,
    case_relu_backward,
    case_residual,
    case_rope,
)

CUDA = Target("cuda", lambda a: cuda.to_device(a.copy()), lambda d: d.copy_to_host())
SEEDS = range(5)


def test_the_target_asked_for_runs():
    """The cases below run where PYML_CUDA_TARGET says: the simulator's arrays, or a GPU's."""
    check_target()


@pytest.mark.parametrize("seed", SEEDS)
def test_frozen_linear_with_lora_adapters(seed):
    """the frozen linear map with LoRA adapters, as tests/proofs/test_conformance.py on the CPU."""
    case_frozen_linear(CUDA, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(seed, bias, product_route):
    """linear forward == matMul X (transpose W) (+ vecAdd b per row); dX == matMul G W (Lean law
    linear_weight_adjoint_input), dW == matMul (transpose G) X (linear_weight_adjoint_weight),
    db == matMul (transpose 1) G (matmul_adjoint_right for the bias term 1 bᵀ)."""
    case_linear(CUDA, seed, bias)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("scaled", [False, True])
def test_embedding(config, seed, scaled):
    """embedding forward == gather E ids; backward == scatterAdd G ids, accumulating (Lean law
    embedding_adjoint); scaled by an integer s, forward == hadamard (s 1) (gather E ids), backward
    == scatterAdd (hadamard (s 1) G) ids (hadamard_adjoint and embedding_adjoint, composed)."""
    case_embedding(CUDA, config, seed, scaled)


@pytest.mark.parametrize("seed", SEEDS)
def test_relu_backward(seed):
    """relu backward == hadamard dy (relu' x) per row (Lean law hadamard_adjoint)."""
    case_relu_backward(CUDA, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_residual(seed):
    """residual forward == vecAdd x r; backward dx + dout == vecAdd dx dout (Lean law
    residual_adjoint)."""
    case_residual(CUDA, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_rope(config, seed):
    """rope forward == rotate c s x1 x2 with integer tables; backward == rotateT c s g1 g2 (Lean
    law rotation_adjoint)."""
    case_rope(CUDA, config, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("window", "packed"), [(0, False), (2, False), (3, False), (0, True), (3, True)])
def test_attention_backward(config, seed, window, packed):
    """attention backward with causal att of dyadic probabilities (multiples of 1/8): dP ==
    matMul G (transpose V) and dQ == scale matMul dS K (Lean law matmul_adjoint_left); dV ==
    Σ_group matMul (transpose P) G and dK == Σ_group scale matMul (transpose dS) Q
    (matmul_adjoint_right); dS = hadamard P (dP - rowsum), the softmax backward, exact here. With a
    sliding window (2, 3), P is zero outside it and the backward is given the window; packed rows
    hold several examples, P is zero across them and the backward is given the positions."""
    case_attention_backward(CUDA, config, seed, window, packed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_attention_forward_one_token(config, seed):
    """attention forward and decode with one token: P == [[1]], O == matMul P V_g (Lean
    definition matMul)."""
    case_attention_forward_one_token(CUDA, config, seed)
