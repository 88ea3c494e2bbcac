"""Exact-model conformance cases, shared by the CPU and the CUDA (simulator) tests.

Layer 3 of "Correctness, in layers" (shared/DESIGN.md): each kernel of a linear map is run on
float64 arrays holding small integers (attention probabilities: multiples of 1/8; the attention
scale: a power of two; the embedding scale: an integer), where float arithmetic is exact in any summation order (every product and
partial sum is a small multiple of a power of two, far inside 53 bits), and it must equal the
Python mirror of the Lean exact model (`pyml/exact.py`) exactly. That links the laws proved in
`lean/PyML/Laws.lean` about `matMul`, `gather`, `rotate`, ... to the code that runs.

Comparison is `==` on the values (`np.array_equal`), after converting the exact model's int lists
with `np.array(..., dtype=np.float64)`: the exact model has no signed zero, so -0.0 (which a
kernel can produce legitimately, e.g. 0 * -3) compares equal to 0.

A case function takes a `Target` (the kernel target, how to load its kernels and how to move
arrays to and from the device) and a seed; seed 0 draws every free size as 1. The test modules
parametrise them: tests/proofs/test_conformance.py on the CPU, tests/cuda/conformance_cuda_cases.py under
Numba's CUDA simulator.

Not covered, because not exact: the SwiGLU's and GeGLU's product parts (x * silu(g) and
x * gelu_tanh(g); neither activation is a polynomial; their element-wise-product structure is the
same `hadamard` checked here through the ReLU backward), the softmax forward for more than one
token (with or without a window), RMSNorm (with or without the unit offset, per row or per head),
cross-entropy, AdamW. Those are checked numerically (layer 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pyml import exact
from tests.support.kernel_harness import load

LOW, HIGH = -8, 8  # integer inputs are drawn from [LOW, HIGH]
MAX_SEQ = 8  # rows of the integer rope tables

# Kernels whose dims are compile-time constants are rendered for two small configurations; the
# second one has every size it can at 1 (vocab, dim, rope half-dim, kv heads). The attention scale
# is an exact power of two: 1/sqrt(head_dim) in the first (head_dim a power of 4), another one in the
# second (as Gemma's query_pre_attn_scalar can make it).
CONFIGS = {
    "small": dict(vocab=5, dim=3, rope_head_dim=6, n_heads=4, n_kv_heads=2, head_dim=4, scale=0.5),
    "ones": dict(vocab=1, dim=1, rope_head_dim=2, n_heads=3, n_kv_heads=1, head_dim=16, scale=0.125),
}
# the scaled embedding's scale (Gemma's is sqrt(dim)): an integer, so that the products are exact
EMBEDDING_SCALE = 3.0


@dataclass(frozen=True)
class Target:
    name: str  # "cpu" or "cuda"
    to_device: Callable[[np.ndarray], Any]
    to_host: Callable[[Any], np.ndarray]

    def kernels(self, blocks):
        return load(self.name, blocks)


CPU = Target("cpu", lambda a: np.ascontiguousarray(a).copy(), lambda a: np.asarray(a))


def config_blocks(config: str) -> list[tuple[str, dict]]:
    c = CONFIGS[config]
    return [
        ("embedding", dict(p="tok", vocab_size=c["vocab"], dim=c["dim"], scale=1.0)),
        ("embedding", dict(p="tok_scaled", vocab_size=c["vocab"], dim=c["dim"],
                           scale=EMBEDDING_SCALE)),
        ("rope", dict(p="rope", head_dim=c["rope_head_dim"], theta=10000.0, max_seq_len=MAX_SEQ)),
        (
            "attention",
            dict(
                p="attn", n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"], head_dim=c["head_dim"],
                scale=c["scale"],
            ),
        ),
        ("relu", dict(p="relu")),
    ]


class Draw:
    """Small integers and sizes from a seed; seed 0 makes every size 1."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.ones = seed == 0

    def size(self, high: int = 6) -> int:
        return 1 if self.ones else int(self.rng.integers(1, high + 1))

    def ints(self, *shape, low=LOW, high=HIGH) -> np.ndarray:
        return self.rng.integers(low, high + 1, size=shape).astype(np.float64)


def as_ints(a: np.ndarray) -> list:
    """A float array of integers as (nested) Python int lists, the exact model's values."""
    assert np.array_equal(a, np.round(a)), "input is not integer-valued"
    return a.astype(np.int64).tolist()


def assert_exact(actual, expected, what: str):
    """`actual` (a float64 array) equals `expected` (the exact model's ints) value for value."""
    expected = np.array(expected, dtype=np.float64)
    assert actual.dtype == np.float64, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = np.argwhere(actual != expected)
        first = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {actual.size} entries differ from the exact model; first at "
            f"{first}: kernel {actual[first]!r}, exact {expected[first]!r}"
        )


def run(target: Target, fn, *arrays, scalars=()):
    """Call `fn` on device copies of `arrays` (then `scalars`); return the arrays back on the host."""
    dev = [target.to_device(a) for a in arrays]
    fn(*dev, *scalars)
    return [target.to_host(d) for d in dev]


# ---------------------------------------------------------------------------------------------
# linear


def case_linear(target: Target, seed: int, bias: bool):
    d = Draw(seed)
    n, k, m = d.size(), d.size(), d.size()  # tokens, in_features, out_features
    kern = target.kernels([("linear", dict(p="fc", in_features=k, out_features=m, bias=bias))])
    x, w, b, g = d.ints(n, k), d.ints(m, k), d.ints(m), d.ints(n, m)
    X, W, B, G = as_ints(x), as_ints(w), as_ints(b), as_ints(g)
    garbage = 99.0  # outputs are overwritten: start them non-zero
    y0, dx0, dw0, db0 = (np.full(s, garbage) for s in [(n, m), (n, k), (m, k), (m,)])

    # forward: Y = X Wᵀ (+ 1 bᵀ)
    expected_y = exact.mat_mul(X, exact.transpose(W))
    if bias:
        expected_y = [exact.vec_add(row, bias_row)
                      for row, bias_row in zip(expected_y, exact.broadcast(n, B), strict=True)]
        y = run(target, kern.fc_forward, x, w, b, y0)[3]
    else:
        y = run(target, kern.fc_forward, x, w, y0)[2]
    assert_exact(y, expected_y, "linear forward Y = X Wᵀ")

    # backward
    if bias:
        out = run(target, kern.fc_backward, x, w, g, dx0, dw0, db0)
        dx, dw, db = out[3], out[4], out[5]
    else:
        out = run(target, kern.fc_backward, x, w, g, dx0, dw0)
        dx, dw = out[3], out[4]
    assert_exact(dx, exact.mat_mul(G, W), "linear dX = G W")
    assert_exact(dw, exact.mat_mul(exact.transpose(G), X), "linear dW = Gᵀ X")
    if bias:
        # the bias term broadcasts b to every row: its adjoint is the column sum (Lean law
        # bias_adjoint)
        assert_exact(db, exact.col_sum(G), "linear db = colSum G")


# ---------------------------------------------------------------------------------------------
# embedding


def case_embedding(target: Target, config: str, seed: int, scaled: bool):
    """The gather and its adjoint scatter-add; with `scaled`, times the integer EMBEDDING_SCALE s:
    the forward is hadamard (s 1) (gather E ids) per row, the backward scatterAdd (hadamard (s 1) G)
    ids (Lean laws embedding_adjoint, hadamard_adjoint, composed by compose_adjoint)."""
    c = CONFIGS[config]
    kern = target.kernels(config_blocks(config))
    forward, backward = (kern.tok_scaled_forward, kern.tok_scaled_backward) if scaled else (
        kern.tok_forward, kern.tok_backward)
    d = Draw(seed)
    vocab, dim, n = c["vocab"], c["dim"], d.size()
    ids = d.rng.integers(0, vocab, size=n).astype(np.int64)
    if n >= 2:
        ids[-1] = ids[0]  # a repeated id, so the scatter-add really adds
    table, g, dtable0 = d.ints(vocab, dim), d.ints(n, dim), d.ints(vocab, dim)
    E, G, IDS = as_ints(table), as_ints(g), ids.tolist()
    scale = [int(EMBEDDING_SCALE) if scaled else 1] * dim  # the constant gain, as a vector

    out = run(target, forward, ids, table, np.full((n, dim), 99.0))[2]
    expected = [exact.hadamard(scale, row) for row in exact.gather(E, IDS)]
    what = "hadamard (s 1) (gather E ids)" if scaled else "gather E ids"
    assert_exact(out, expected, f"embedding forward = {what}")

    scaled_g = [exact.hadamard(scale, row) for row in G]
    scattered = exact.scatter_add(scaled_g, IDS, vocab)
    what = "scatterAdd (hadamard (s 1) G) ids" if scaled else "scatterAdd G ids"
    dtable = run(target, backward, ids, g, np.zeros((vocab, dim)))[2]
    assert_exact(dtable, scattered, f"embedding backward (zeroed dtable) = {what}")
    # the backward accumulates (a tied LM head adds into the same buffer)
    dtable = run(target, backward, ids, g, dtable0)[2]
    expected = [exact.vec_add(r0, r) for r0, r in zip(as_ints(dtable0), scattered, strict=True)]
    assert_exact(dtable, expected, f"embedding backward accumulates: dtable + {what}")


# ---------------------------------------------------------------------------------------------
# element-wise: relu backward (a hadamard product with the 0/1 derivative), residual


def case_relu_backward(target: Target, seed: int):
    kern = target.kernels(config_blocks("small"))
    d = Draw(seed)
    n, width = d.size(), d.size()
    x, dy = d.ints(n, width), d.ints(n, width)
    if not d.ones:
        x[0, 0] = 0.0  # relu'(0) = 0, torch's convention
    dx = run(target, kern.relu_backward, x, dy, np.full((n, width), 99.0))[2]
    mask = [[1 if v > 0 else 0 for v in row] for row in as_ints(x)]
    expected = [exact.hadamard(g, m) for g, m in zip(as_ints(dy), mask, strict=True)]
    assert_exact(dx, expected, "relu backward dx = dy ⊙ relu'(x)")


def case_residual(target: Target, seed: int):
    kern = target.kernels(config_blocks("small"))
    d = Draw(seed)
    n, width = d.size(), d.size()
    x, r, g, dx0 = d.ints(n, width), d.ints(n, width), d.ints(n, width), d.ints(n, width)
    out = run(target, kern.residual_add, x, r, np.full((n, width), 99.0))[2]
    expected = [exact.vec_add(a, b) for a, b in zip(as_ints(x), as_ints(r), strict=True)]
    assert_exact(out, expected, "residual forward out = x + r")
    dx = run(target, kern.add_into, dx0, g)[0]
    expected = [exact.vec_add(a, b) for a, b in zip(as_ints(dx0), as_ints(g), strict=True)]
    assert_exact(dx, expected, "residual backward dx += dout")


def case_linear_bf16(seed: int, bias: bool):
    """The bf16 linear kernels (`pyml train --precision bf16`, CPU) on float32 integers up to 600,
    where bfloat16 keeps 8 significant bits (257 is not one), in sizes that take whole and partial
    8 x 32 tiles: each product equals the exact one of the operands as the mirror rounds them
    (exact.round_bf16), and float32 holds its every partial sum (under 2^24)."""
    from pyml.package.cpu import linear

    d = Draw(seed)
    n, k, m = d.size(40), d.size(40), d.size(40)  # tokens, in_features, out_features
    x, w, b, g = (d.ints(*shape, low=-600, high=600).astype(np.float32) for shape in [(n, k), (m, k), (m,), (n, m)])
    X, W, G = (exact.round_bf16_matrix(as_ints(a)) for a in (x, w, g))  # as the kernels round them
    y, dx, dw, db = (np.full(shape, 99.0, np.float32) for shape in [(n, m), (n, k), (m, k), (m,)])
    expected_y = exact.mat_mul(X, exact.transpose(W))
    if bias:
        linear.linear_bias_forward_bf16(x, w, b, y)
        expected_y = [exact.vec_add(row, as_ints(b)) for row in expected_y]  # the bias is not rounded
        linear.linear_bias_backward_bf16(x, w, g, dx, dw, db)
        assert_exact(db.astype(np.float64), exact.col_sum(as_ints(g)), "bf16 linear db = colSum G (float32, unrounded)")
    else:
        linear.linear_forward_bf16(x, w, y)
        linear.linear_backward_bf16(x, w, g, dx, dw)
    assert_exact(y.astype(np.float64), expected_y, "bf16 linear forward Y = X Wᵀ of the rounded operands")
    assert_exact(dx.astype(np.float64), exact.mat_mul(G, W), "bf16 linear dX = G W of the rounded operands")
    # a product split along k at an even index, its second part added (a LoRA base's tiles of rows)
    split = 2 * (m // 4)
    parts = np.full((n, k), 99.0, np.float32)
    linear.product_into(g[:, :split], False, w[:split], True, parts)
    linear.product_into(g[:, split:], False, w[split:], True, parts, add=split > 0)
    assert np.array_equal(parts, dx), "bf16 dX = G W in two parts along k, the second added"
    assert_exact(dw.astype(np.float64), exact.mat_mul(exact.transpose(G), X), "bf16 linear dW = Gᵀ X of the rounded operands")


def case_linear_bf16_long_k(seed: int):
    """The bf16 products over a k of several blocks (bf16_products.BLOCK_PAIRS pairs each, the
    later ones continuing the sums) and odd (a last pair padded with zero): integers in [-3, 3]
    with one in a hundred 257..271 (bfloat16 rounds the odd ones), so every partial sum stays
    exact in float32; each product equals the exact one of the rounded operands."""
    from pyml.package.bf16_products import BLOCK_PAIRS
    from pyml.package.cpu import linear

    rng = np.random.default_rng(seed)
    n, k, m = 9, 4 * BLOCK_PAIRS + 1, 33

    def draw(*shape):
        values = rng.integers(-3, 4, size=shape)
        large = rng.random(shape) < 0.01
        values[large] = rng.integers(257, 272, size=int(large.sum())) * rng.choice([-1, 1], size=int(large.sum()))
        return values.astype(np.float32)

    x, w, g = draw(n, k), draw(m, k), draw(n, m)
    X, W, G = (exact.round_bf16_matrix(as_ints(a)) for a in (x, w, g))
    y, dx, dw = (np.full(shape, 99.0, np.float32) for shape in [(n, m), (n, k), (m, k)])
    linear.linear_forward_bf16(x, w, y)
    linear.linear_backward_bf16(x, w, g, dx, dw)
    assert_exact(y.astype(np.float64), exact.mat_mul(X, exact.transpose(W)), "bf16 Y = X Wᵀ over blocks of k")
    assert_exact(dx.astype(np.float64), exact.mat_mul(G, W), "bf16 dX = G W")
    assert_exact(dw.astype(np.float64), exact.mat_mul(exact.transpose(G), X), "bf16 dW = Gᵀ X")


# ---------------------------------------------------------------------------------------------
# a frozen linear map with LoRA adapters


def case_frozen_linear(target: Target, seed: int):
    """y = x Wᵀ with adapters scale (x Aᵢᵀ) Bᵢᵀ added to two row blocks; W frozen. Scale 2 (alpha /
    rank, a power of two) keeps the products exact."""
    d = Draw(seed)
    n, k, rank = d.size(), d.size(), d.size(3)
    first, second = d.size(3), d.size(3)  # rows of the two adapted blocks, then one left alone
    m = first + second + 1
    adapters = ((0, first), (first, first + second))
    kern = target.kernels([("frozen_linear", dict(p="fc", in_features=k, out_features=m,
                                                  bias=False, adapters=adapters, rank=rank,
                                                  scale=2.0))])
    x, w, g = d.ints(n, k), d.ints(m, k), d.ints(n, m)
    a = [d.ints(rank, k) for _ in adapters]
    b = [d.ints(stop - start, rank) for start, stop in adapters]
    X, W, G = as_ints(x), as_ints(w), as_ints(g)
    A, Bs = [as_ints(t) for t in a], [as_ints(t) for t in b]
    garbage = 99.0
    h0 = [np.full((n, rank), garbage) for _ in adapters]
    out = run(target, kern.fc_forward, x, w, a[0], b[0], a[1], b[1], np.full((n, m), garbage), *h0)
    y, h = out[6], out[7:]
    H = [exact.mat_mul(X, exact.transpose(Ai)) for Ai in A]
    expected = exact.mat_mul(X, exact.transpose(W))
    for (start, stop), Hi, Bi in zip(adapters, H, Bs, strict=True):
        lora = exact.mat_mul(Hi, exact.transpose(Bi))  # B A applied to x: compose_adjoint's chain
        for row, lora_row in zip(expected, lora, strict=True):
            row[start:stop] = exact.vec_add(row[start:stop], exact.smul(2, lora_row))
    assert_exact(y, expected, "frozen linear forward Y = X Wᵀ + 2 (X Aᵀ) Bᵀ per adapter")
    for hi, Hi in zip(h, H, strict=True):
        assert_exact(hi, Hi, "frozen linear saves H = X Aᵀ")

    grads0 = [np.full(t.shape, garbage) for pair in zip(a, b) for t in pair]
    out = run(target, kern.fc_backward, x, w, a[0], b[0], a[1], b[1], h[0], h[1], g,
              np.full((n, k), garbage), *grads0)
    dx, da0, db0, da1, db1 = out[9], out[10], out[11], out[12], out[13]
    expected_dx = exact.mat_mul(G, W)
    for (start, stop), Ai, Bi, Hi, da, db in zip(adapters, A, Bs, H, (da0, da1), (db0, db1),
                                                 strict=True):
        G_part = [row[start:stop] for row in G]
        # the adapter's output is 2 H Bᵀ: dB = 2 Gᵀ H, dH = 2 G B, dA = dHᵀ X, dX += dH A
        assert_exact(db, exact.mat_mul(exact.transpose([exact.smul(2, r) for r in G_part]), Hi),
                     "adapter dB = 2 Gᵀ H")
        dH = [exact.smul(2, r) for r in exact.mat_mul(G_part, Bi)]
        assert_exact(da, exact.mat_mul(exact.transpose(dH), X), "adapter dA = dHᵀ X")
        expected_dx = [exact.vec_add(r, s) for r, s in zip(expected_dx, exact.mat_mul(dH, Ai),
                                                           strict=True)]
    assert_exact(dx, expected_dx, "frozen linear dX = G W + Σ dH A (no dW: W is frozen)")


# ---------------------------------------------------------------------------------------------
# rope, with integer cos/sin tables


def packed_positions(d: Draw, b: int, t: int) -> np.ndarray:
    """(b, t) positions of tokens in rows that pack examples at random starts (position 0 at each
    example's first token); the first example has 2 tokens or more where t > 1, so that the softmax
    backward is not zero; seed 0 gives one example per row."""
    positions = np.zeros((b, t), dtype=np.int64)
    for bi in range(b):
        starts = {0} | ({int(i) for i in d.rng.integers(2, t, size=t // 2)} if t > 2 and not d.ones else set())
        for i in range(t):
            positions[bi, i] = i - max(start for start in starts if start <= i)
    return positions


def case_rope(target: Target, config: str, seed: int):
    c = CONFIGS[config]
    kern = target.kernels(config_blocks(config))
    d = Draw(seed)
    half = c["rope_head_dim"] // 2
    b, t, h = d.size(2), d.size(), d.size(3)
    positions = packed_positions(d, b, t)
    # integer "cos" and "sin" tables: the law holds for any values c, s
    cos, sin = d.ints(MAX_SEQ, half, low=-3, high=3), d.ints(MAX_SEQ, half, low=-3, high=3)
    x, g = d.ints(b, t, h, 2 * half), d.ints(b, t, h, 2 * half)
    C, S, X, G = as_ints(cos), as_ints(sin), as_ints(x), as_ints(g)

    y = run(target, kern.rope_forward, x, cos, sin, positions)[0]
    expected = np.zeros_like(x)
    for bi, ti, hi in np.ndindex(b, t, h):
        v, pos = X[bi][ti][hi], positions[bi, ti]
        o1, o2 = exact.rotate(C[pos], S[pos], v[:half], v[half:])
        expected[bi, ti, hi] = o1 + o2
    assert_exact(y, expected, f"rope forward = rotate (at positions {positions.tolist()})")

    dx = run(target, kern.rope_backward, g, cos, sin, positions)[0]
    expected = np.zeros_like(g)
    for bi, ti, hi in np.ndindex(b, t, h):
        v, pos = G[bi][ti][hi], positions[bi, ti]
        o1, o2 = exact.rotate_t(C[pos], S[pos], v[:half], v[half:])
        expected[bi, ti, hi] = o1 + o2
    assert_exact(dx, expected, f"rope backward = rotateT (at positions {positions.tolist()})")

    # decoding: one new token per sequence at one position
    position = 0 if d.ones else int(d.rng.integers(0, MAX_SEQ))
    y = run(target, kern.rope_decode, x[:, :1], cos, sin, scalars=(position,))[0]
    for bi, hi in np.ndindex(b, h):
        v = X[bi][0][hi]
        o1, o2 = exact.rotate(C[position], S[position], v[:half], v[half:])
        expected[bi, 0, hi] = o1 + o2
    assert_exact(y, expected[:, :1], f"rope decode = rotate (at position {position})")


# ---------------------------------------------------------------------------------------------
# attention: the two matmuls S = Q Kᵀ and O = P V


def attention_scale(config: str) -> float:
    scale = CONFIGS[config]["scale"]
    assert math.frexp(scale)[0] == 0.5, "the attention scale must be an exact power of two"
    return scale


PROB_BITS = 3  # attention probabilities are multiples of 2**-PROB_BITS


def dyadic_causal(d: Draw, b: int, heads: int, t: int, window: int, positions: np.ndarray) -> np.ndarray:
    """Integer numerators of causal attention probabilities with denominator 2**PROB_BITS.

    Most rows spread 2**PROB_BITS units over all the columns row i attends to, j <= i (and with a
    window W > 0, j > i - W; and from the start of i's example, i - positions[i]), each at least 1 (t <= 2**PROB_BITS here): positive there and summing
    to 1 after the division, that is exactly a softmax output (of the logs of the entries). The
    other rows are one-hot at a random one of those columns (a limit of softmax outputs).
    Not one-hot only: with a one-hot P the softmax backward dS = P ⊙ (dP - rowsum) is identically
    zero, which would make the dQ and dK checks vacuous.
    """
    units = 2**PROB_BITS
    assert t <= units
    num = np.zeros((b, heads, t, t), dtype=np.int64)
    for bi, hi, i in np.ndindex(b, heads, t):
        start = max(i - window + 1 if window > 0 else 0, i - int(positions[bi, i]))
        width = i + 1 - start if d.rng.random() < 0.8 else 1  # some rows one-hot
        cols = np.sort(d.rng.choice(np.arange(start, i + 1), size=width, replace=False))
        # a random composition of `units` into `width` positive parts
        cuts = np.sort(d.rng.choice(np.arange(1, units), size=width - 1, replace=False))
        parts = np.diff(np.concatenate([[0], cuts, [units]]))
        num[bi, hi, i, cols] = parts
    return num


def case_attention_backward(target: Target, config: str, seed: int, window: int, packed: bool):
    """With a window W > 0, att is zero outside t - W < j <= t and the backward is given W; with
    `packed`, rows hold several examples (random starts) and att is zero across them, the backward
    given the positions: the products are the same matMul adjoints, masked by the zeros of P."""
    c = CONFIGS[config]
    kern = target.kernels(config_blocks(config))
    d = Draw(seed)
    heads, kv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    group, scale = heads // kv, attention_scale(config)
    # one token only at seed 0: there the softmax has a single column and dS is 0
    b, t = d.size(2), (1 if d.ones else int(d.rng.integers(2, 6)))
    q, k, v = d.ints(b, t, heads, hd), d.ints(b, t, kv, hd), d.ints(b, t, kv, hd)
    dout = d.ints(b, t, heads * hd)
    # P = N / u with integer numerators N and u = 2**PROB_BITS; the exact model runs on N and the
    # results are scaled at the end by powers of two (exact): matMul is linear, so
    # Pᵀ G = (Nᵀ G) / u, and dS = P ⊙ (dP - rowsum) = (N ⊙ (u dP - rowsum_N)) / u² with
    # rowsum_N[i] = dot N[i] dP[i].
    u = 2**PROB_BITS
    positions = packed_positions(d, b, t) if packed else np.tile(np.arange(t), (b, 1))
    num = dyadic_causal(d, b, heads, t, window, positions)
    att = num.astype(np.float64) / u
    garbage = [np.full(a.shape, 99.0) for a in (q, k, v)]
    backward = lambda *arrays: kern.attn_backward(*arrays[:-1], window, arrays[-1])  # noqa: E731
    dq, dk, dv = run(target, backward, q, k, v, att, dout, *garbage, positions)[5:8]

    dout4 = dout.reshape(b, t, heads, hd)
    exp_dq, exp_dk, exp_dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    nonzero_ds = False
    for bi in range(b):
        for g in range(kv):
            K, V = as_ints(k[bi, :, g]), as_ints(v[bi, :, g])
            dk_sum = [[0] * hd for _ in range(t)]
            dv_sum = [[0] * hd for _ in range(t)]
            for h in range(g * group, (g + 1) * group):
                N, G, Q = num[bi, h].tolist(), as_ints(dout4[bi, :, h]), as_ints(q[bi, :, h])
                # O = P V: dP = G Vᵀ (matmul_adjoint_left), dV = Pᵀ G (matmul_adjoint_right)
                dP = exact.mat_mul(G, exact.transpose(V))
                dv_sum = [
                    exact.vec_add(a, r)
                    for a, r in zip(dv_sum, exact.mat_mul(exact.transpose(N), G), strict=True)
                ]
                # softmax backward (no Lean law; exact here), numerators over u²
                row = [exact.dot(N[i], dP[i]) for i in range(t)]
                dS = [exact.hadamard(N[i], [u * x - row[i] for x in dP[i]]) for i in range(t)]
                nonzero_ds |= any(any(r) for r in dS)
                # S = scale Q Kᵀ: dQ = scale dS K (matmul_adjoint_left), dK = scale dSᵀ Q (right)
                exp_dq[bi, :, h] = np.array(exact.mat_mul(dS, K), dtype=np.float64) * (scale / u**2)
                dk_sum = [
                    exact.vec_add(a, r)
                    for a, r in zip(dk_sum, exact.mat_mul(exact.transpose(dS), Q), strict=True)
                ]
            exp_dk[bi, :, g] = np.array(dk_sum, dtype=np.float64) * (scale / u**2)
            exp_dv[bi, :, g] = np.array(dv_sum, dtype=np.float64) / u
    if t > 1:
        assert nonzero_ds, "degenerate draw: dS is zero, the dQ and dK checks would be vacuous"
    assert_exact(dv, exp_dv, "attention dV = Σ_group Pᵀ G")
    assert_exact(dq, exp_dq, "attention dQ = scale dS K")
    assert_exact(dk, exp_dk, "attention dK = Σ_group scale dSᵀ Q")


def case_attention_forward_one_token(target: Target, config: str, seed: int):
    """With T = 1 the softmax is exactly [[1]] (exp(0) / exp(0)), so O = P V = V is exact."""
    c = CONFIGS[config]
    kern = target.kernels(config_blocks(config))
    d = Draw(seed)
    heads, kv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    group, b = heads // kv, d.size(3)
    q, k, v = d.ints(b, 1, heads, hd), d.ints(b, 1, kv, hd), d.ints(b, 1, kv, hd)
    att0, out0 = np.full((b, heads, 1, 1), 99.0), np.full((b, 1, heads * hd), 99.0)
    forward = lambda *arrays: kern.attn_forward(*arrays[:-1], 0, arrays[-1])  # noqa: E731
    att, out = run(target, forward, q, k, v, att0, out0, np.zeros((b, 1), np.int64))[3:5]
    assert_exact(att, np.ones((b, heads, 1, 1)), "attention forward, T = 1: P = [[1]]")
    expected = np.zeros((b, 1, heads, hd))
    for bi, h in np.ndindex(b, heads):
        expected[bi, :, h] = exact.mat_mul([[1]], as_ints(v[bi, :, h // group]))
    assert_exact(out, expected.reshape(b, 1, heads * hd), "attention forward, T = 1: O = P V")

    # the decode kernel at length 1 (online softmax over one cached position) is the same product
    cache_len = 3
    k_cache, v_cache = d.ints(b, cache_len, kv, hd), d.ints(b, cache_len, kv, hd)
    k_cache[:, :1], v_cache[:, :1] = k, v
    decode = lambda q, kc, vc, out: kern.attn_decode(q, kc, vc, 1, out)  # noqa: E731
    out = run(target, decode, q, k_cache, v_cache, np.full((b, 1, heads * hd), 99.0))[3]
    assert_exact(out, expected.reshape(b, 1, heads * hd), "attention decode, length 1: O = P V")


# ---------------------------------------------------------------------------------------------
# a frozen linear map on rows read where they are stored (QLoRA; CPU only)

STORED_ROW_TYPES = ("Q8_0", "Q4_0", "BF16", "F16", "F32")


def stored_row_bytes(kind: str, values: np.ndarray) -> np.ndarray:
    """One row of small integers (a whole number of 32-value blocks) in `kind`'s bytes, with the
    block scale 1 (so that the dequantized row is `values` exactly)."""
    one = np.array([1.0], np.float16).view(np.uint8)
    if kind == "Q8_0":  # per block: f16 d, 32 int8 q; value q * d
        return np.concatenate([np.concatenate([one, block.astype(np.int8).view(np.uint8)])
                               for block in values.reshape(-1, 32)])
    if kind == "Q4_0":  # per block: f16 d, 16 bytes (value j low nibble, j + 16 high); (q - 8) * d
        return np.concatenate([np.concatenate([one, ((block[:16] + 8) | ((block[16:] + 8) << 4)).astype(np.uint8)])
                               for block in values.reshape(-1, 32).astype(np.int64)])
    if kind == "BF16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.astype({"F16": np.float16, "F32": np.float32}[kind]).view(np.uint8)


def case_frozen_linear_stored(seed: int, kinds: tuple[str, ...], dtype):
    """y = x Wᵀ and dX = G W with W's rows read where they are stored, each row of one of `kinds`
    (several: a layer of mixed rows), block scales 1: W is the exact model's matrix of the rows'
    dequantized values. float64 runs the tiles' BLAS products; float32 with few rows the decode
    step's row products (exact too: every partial sum is a small integer)."""
    from pyml.weight_formats import GGMLType, dequantize
    from pyml.package.decode_cpu import row_addresses, stored_weight
    from pyml.package.stored_rows import StoredRows

    d = Draw(seed)
    n, k, m = d.size(), 32 * d.size(2), d.size(40)
    kern = load("cpu", [("frozen_linear", dict(p="fc", in_features=k, out_features=m, bias=False,
                                               adapters=(), rank=1, scale=1.0))])
    row_kinds = [kinds[int(d.rng.integers(len(kinds)))] for _ in range(m)]
    values = d.ints(m, k, low=-8, high=7)
    rows = [stored_row_bytes(kind, row) for kind, row in zip(row_kinds, values, strict=True)]
    for kind, row, raw in zip(row_kinds, values, rows, strict=True):  # the bytes mean W
        assert np.array_equal(dequantize(raw, GGMLType[kind], (k,)), row), kind
    addresses = np.array([row_addresses(raw, 1)[0] for raw in rows], np.uint64)
    weight = stored_weight(np.array([[GGMLType[kind] for kind in row_kinds]]),
                           addresses[None, :])
    w = StoredRows(weight, 0, (m, k), dtype, "/".join(sorted(set(row_kinds))))
    x, g = d.ints(n, k).astype(dtype), d.ints(n, m).astype(dtype)
    X, W, G = as_ints(x.astype(np.float64)), as_ints(values), as_ints(g.astype(np.float64))
    y = np.full((n, m), 99.0, dtype)
    kern.fc_forward(x, w, y)
    assert_exact(y.astype(np.float64), exact.mat_mul(X, exact.transpose(W)),
                 f"frozen linear forward Y = X Wᵀ on {w.formats} rows")
    dx = np.full((n, k), 99.0, dtype)
    kern.fc_backward(x, w, g, dx)
    assert_exact(dx.astype(np.float64), exact.mat_mul(G, W),
                 f"frozen linear dX = G W on {w.formats} rows")
    del rows  # the addresses point into these: kept alive until here
