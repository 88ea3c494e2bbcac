"""Float64 central finite differences for the non-linear kernels' backward passes.

For a scalar L = <c, f(x)> with a fixed random cotangent c, the analytic gradient from the backward
kernel, dotted with a random direction u, must equal (L(x + h u) - L(x - h u)) / 2h to rel 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.kernel_harness import ATTENTION_SCALES, DIMS, all_blocks, load

D, HIDDEN = DIMS["dim"], DIMS["hidden"]
H, KV, HD, C = DIMS["n_heads"], DIMS["n_kv_heads"], DIMS["head_dim"], DIMS["classes"]
STEP = 1e-6
REL_TOL = 1e-6


@pytest.fixture(scope="module")
def k():
    return load("cpu", all_blocks("cpu"))


def check(loss, inputs, grads, rng):
    """loss(*inputs) -> float; grads: the analytic gradient of each input."""
    directions = [rng.standard_normal(x.shape) for x in inputs]
    analytic = sum(float(np.sum(g * u)) for g, u in zip(grads, directions, strict=True))
    plus = loss(*[x + STEP * u for x, u in zip(inputs, directions, strict=True)])
    minus = loss(*[x - STEP * u for x, u in zip(inputs, directions, strict=True)])
    numeric = (plus - minus) / (2 * STEP)
    assert abs(numeric - analytic) <= REL_TOL * max(abs(analytic), 1e-3), (numeric, analytic)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("prefix", ["norm", "norm_offset"])  # gain w, gain 1 + w
def test_rmsnorm(k, seed, prefix):
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    rng = np.random.default_rng(seed)
    x, w, c = rng.standard_normal((5, D)), rng.standard_normal(D), rng.standard_normal((5, D))

    def loss(x, w):
        y, rstd = np.empty_like(x), np.empty(x.shape[0])
        forward(x, w, y, rstd)
        return float(np.sum(c * y))

    y, rstd, dx, dw = np.empty_like(x), np.empty(5), np.empty_like(x), np.empty_like(w)
    forward(x, w, y, rstd)
    backward(x, w, rstd, c, dx, dw)
    check(loss, [x, w], [dx, dw], rng)


@pytest.mark.parametrize("seed", range(3))
def test_layernorm(k, seed):
    forward, backward = k.layer_norm_forward, k.layer_norm_backward
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((5, D)), rng.standard_normal(D), rng.standard_normal(D)
    c = rng.standard_normal((5, D))

    def loss(x, w, b):
        y, mean, rstd = np.empty_like(x), np.empty(x.shape[0]), np.empty(x.shape[0])
        forward(x, w, b, y, mean, rstd)
        return float(np.sum(c * y))

    y, mean, rstd = np.empty_like(x), np.empty(5), np.empty(5)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    forward(x, w, b, y, mean, rstd)
    backward(x, w, mean, rstd, c, dx, dw, db)
    check(loss, [x, w, b], [dx, dw, db], rng)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("prefix", "heads"), [("q_norm", H), ("k_norm", KV)])
def test_head_rmsnorm(k, seed, prefix, heads):
    # on strided views (every other head of a wider buffer), as the fused q/k/v buffer gives them
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    rng = np.random.default_rng(seed)
    x, c = rng.standard_normal((5, heads, HD)), rng.standard_normal((5, heads, HD))
    w = rng.standard_normal(HD)

    def strided(a):
        wide = np.zeros((a.shape[0], 2 * heads, HD))
        wide[:, ::2] = a
        return wide[:, ::2]

    def loss(x, w):
        y, rstd = strided(np.empty_like(x)), np.empty((x.shape[0], heads))
        forward(strided(x), w, y, rstd)
        return float(np.sum(c * y))

    y, dx = strided(np.empty_like(x)), strided(np.empty_like(x))
    rstd, dw = np.empty((5, heads)), np.empty_like(w)
    forward(strided(x), w, y, rstd)
    backward(strided(x), w, rstd, strided(c), dx, dw)
    check(loss, [x, w], [dx, dw], rng)


@pytest.mark.parametrize("kind", ["silu", "gelu"])
def test_activation(k, kind):
    rng = np.random.default_rng(0)
    x, c = rng.standard_normal((4, HIDDEN)) * 3, rng.standard_normal((4, HIDDEN))
    forward, backward = getattr(k, f"{kind}_forward"), getattr(k, f"{kind}_backward")

    def loss(x):
        y = np.empty_like(x)
        forward(x, y)
        return float(np.sum(c * y))

    dx = np.empty_like(x)
    backward(x, c, dx)
    check(loss, [x], [dx], rng)


@pytest.mark.parametrize("prefix", ["mlp", "geglu"])  # SwiGLU, GeGLU
def test_gated_mlp(k, prefix):
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    rng = np.random.default_rng(1)
    gate_up, c = rng.standard_normal((4, 2 * HIDDEN)) * 3, rng.standard_normal((4, HIDDEN)) * 3

    def loss(gate_up):
        h = np.empty_like(c)
        forward(gate_up, h)
        return float(np.sum(c * h))

    dgate_up = np.empty_like(gate_up)
    backward(gate_up, c, dgate_up)
    check(loss, [gate_up], [dgate_up], rng)


# packed: each row holds two examples (positions restart at 0 at token 3)
@pytest.mark.parametrize(("seq", "window", "packed"), [(1, 0, False), (6, 0, False), (6, 2, False),
                                                       (6, 6, False), (6, 0, True), (6, 2, True)])
@pytest.mark.parametrize("prefix", ATTENTION_SCALES)
def test_attention(k, seq, window, packed, prefix):
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    rng = np.random.default_rng(seq)
    q, kk, v = (
        rng.standard_normal((2, seq, H, HD)),
        rng.standard_normal((2, seq, KV, HD)),
        rng.standard_normal((2, seq, KV, HD)),
    )
    c = rng.standard_normal((2, seq, H * HD))
    positions = np.tile(np.arange(seq), (2, 1))
    if packed:
        positions[:, 3:] = np.arange(seq - 3)

    def loss(q, kk, v):
        att, out = np.empty((2, H, seq, seq)), np.empty((2, seq, H * HD))
        forward(q, kk, v, att, out, window, positions)
        return float(np.sum(c * out))

    att, out = np.empty((2, H, seq, seq)), np.empty((2, seq, H * HD))
    dq, dk, dv = np.empty_like(q), np.empty_like(kk), np.empty_like(v)
    forward(q, kk, v, att, out, window, positions)
    backward(q, kk, v, att, c, dq, dk, dv, window, positions)
    check(loss, [q, kk, v], [dq, dk, dv], rng)


def test_cross_entropy(k):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((9, C)) * 3
    targets = rng.integers(0, C, 9).astype(np.int64)
    targets[4] = -100
    dlogits = np.empty_like(logits)
    k.ce_forward_backward(logits, targets, dlogits)
    check(lambda x: k.ce_forward(x, targets), [logits], [dlogits], rng)
