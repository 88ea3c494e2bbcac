"""Every CPU kernel, forward and backward, against PyTorch autograd (and transformers for Llama parts).

float64: rtol 1e-10, atol 1e-12. float32: the per-op tolerances in FLOAT32_TOL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3RMSNorm,
    Gemma3TextScaledWordEmbedding,
)
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pyml.package.kernels_cpu import linear_product
from tests.support.kernel_harness import (
    ATTENTION_SCALES,
    DIMS,
    EMBEDDING_SCALES,
    NORM_EPS,
    ROPE_THETAS,
    UNIT_OFFSET,
    all_blocks,
    load,
)

D, HIDDEN, V = DIMS["dim"], DIMS["hidden"], DIMS["vocab"]
H, KV, HD, C = DIMS["n_heads"], DIMS["n_kv_heads"], DIMS["head_dim"], DIMS["classes"]
MAX_SEQ = 32

# float32 (rtol, atol) per op: our kernels accumulate row sums in float64 where torch sums in
# float32, so results differ by a few float32 ulps of the largest term (unit roundoff 6e-8).
FLOAT32_TOL = {
    "linear": (1e-5, 1e-5),  # BLAS sums of 24-40 products; summation order differs from torch's
    "embedding": (0, 0),  # a gather is exact; the scatter-add sums in the same row order
    "rmsnorm": (1e-5, 1e-6),  # also the unit-offset gain and the per-head (QK) norm
    "layernorm": (1e-5, 1e-5),  # the mean and variance in float64, torch's in float32
    "rope": (1e-6, 1e-6),  # one rotation: 2 products and a sum per output
    "attention": (1e-5, 1e-6),
    # silu, gelu, relu, swiglu, geglu, residual: gelu evaluates in float64 and rounds once, silu,
    # swiglu and geglu use a float32 exp within 1 ulp; torch rounds each intermediate; inputs reach
    # |x| ~ 16, so the absolute error is a few ulps of 16
    "elementwise": (1e-6, 2e-6),
    "cross_entropy": (1e-6, 1e-8),
    "adamw": (1e-5, 1e-7),  # 10 steps; torch rounds each intermediate to float32, we round once
}
FLOAT64_TOL = (1e-10, 1e-12)

DTYPES = [np.float64, np.float32]
ROWS = [1, 7, 33]  # rows N = B*T, including a single row and sizes that are not tile multiples


@pytest.fixture(scope="module")
def k():
    return load("cpu", all_blocks("cpu"))


def tol(dtype, op):
    rtol, atol = FLOAT64_TOL if dtype == np.float64 else FLOAT32_TOL[op]
    return dict(rtol=rtol, atol=atol)


def close(actual, expected, dtype, op):
    if isinstance(expected, torch.Tensor):
        expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, **tol(dtype, op))


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def t(a, grad=False):
    return torch.tensor(a, requires_grad=grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear(k, dtype, n, bias):
    rng = np.random.default_rng(n)
    x, w, b = rand(rng, (n, D), dtype), rand(rng, (HIDDEN, D), dtype), rand(rng, HIDDEN, dtype)
    dy = rand(rng, (n, HIDDEN), dtype)
    y, dx, dw, db = (np.full(s, np.nan, dtype) for s in [(n, HIDDEN), x.shape, w.shape, b.shape])
    tx, tw, tb = t(x, True), t(w, True), t(b, True)
    ty = F.linear(tx, tw, tb if bias else None)
    ty.backward(t(dy))
    if bias:
        k.fc_bias_forward(x, w, b, y)
        k.fc_bias_backward(x, w, dy, dx, dw, db)
        close(db, tb.grad, dtype, "linear")
    else:
        k.fc_forward(x, w, y)
        k.fc_backward(x, w, dy, dx, dw)
    close(y, ty, dtype, "linear")
    close(dx, tx.grad, dtype, "linear")
    close(dw, tw.grad, dtype, "linear")


# the linear forward's product on few rows (kernels_cpu.few_rows_product): every remainder of the
# rows of x and of the weight's rows by its blocks of 4, and the row counts on both sides of the
# switch to OpenBLAS
FEW_ROW_SHAPES = [(2, 5, 3), (3, 7, 9), (5, 24, 41), (7, 24, 40), (33, 24, 42), (63, 17, 43),
                  (64, 24, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "features", "outputs"), FEW_ROW_SHAPES)
def test_linear_product_of_few_rows(dtype, n, features, outputs):
    rng = np.random.default_rng(n)
    x, w = rand(rng, (n, features), dtype), rand(rng, (outputs, features), dtype)
    y = np.full((n, outputs), np.nan, dtype)
    linear_product(x, w, y)
    close(y, F.linear(t(x), t(w)), dtype, "linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("prefix", EMBEDDING_SCALES)
def test_embedding(k, dtype, n, prefix):
    # tok: no scale (the shipped models); tok_scaled: sqrt(dim). In float32 against transformers'
    # Gemma 3 embedding, which rounds the scale to float32 before multiplying; in float64 against
    # the float64 scale (that module would round it to float32 even there: torch.tensor(scale)).
    rng = np.random.default_rng(n)
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    ids = rng.integers(0, 5, n).astype(np.int64)  # few distinct ids, so rows repeat
    table, dout = rand(rng, (V, D), dtype), rand(rng, (n, D), dtype)
    prior = rand(rng, (V, D), dtype)  # the backward accumulates into what dtable already holds
    out, dtable = np.empty((n, D), dtype), prior.copy()
    forward(ids, table, out)
    backward(ids, dout, dtable)
    if dtype == np.float32:
        module = Gemma3TextScaledWordEmbedding(V, D, None, embed_scale=EMBEDDING_SCALES[prefix])
        with torch.no_grad():
            module.weight.copy_(t(table))
        tt = module.weight
        to = module(torch.tensor(ids))
    else:
        tt = t(table, True)
        to = F.embedding(torch.tensor(ids), tt) * EMBEDDING_SCALES[prefix]
    to.backward(t(dout))
    close(out, to, dtype, "embedding")
    np.testing.assert_allclose(dtable, prior + tt.grad.numpy(), **tol(dtype, "linear"))
    with pytest.raises(ValueError):
        forward(np.array([V], np.int64), table, out[:1])


def torch_rmsnorm(x, w, eps, unit_offset):
    gain = 1.0 + w if unit_offset else w
    return gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_reference(x, w, dy, eps, unit_offset):
    """(y, dx, dw) of an RMSNorm over x's last axis with gain w (1 + w with the unit offset), from
    torch autograd: in float32 transformers' own modules (Gemma3RMSNorm with the offset,
    LlamaRMSNorm without; both compute in float32), in float64 the formula."""
    tx, tw = t(x, True), t(w, True)
    if x.dtype == np.float32:
        module = (Gemma3RMSNorm if unit_offset else LlamaRMSNorm)(w.shape[0], eps=eps)
        with torch.no_grad():
            module.weight.copy_(tw)
        tw = module.weight
        ty = module(tx)
    else:
        ty = torch_rmsnorm(tx, tw, eps, unit_offset)
    ty.backward(t(dy))
    return ty, tx.grad, tw.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("prefix", ["norm", "norm_offset"])
def test_rmsnorm(k, dtype, n, prefix):
    # norm: gain w (Llama); norm_offset: gain 1 + w (Gemma)
    forward = getattr(k, f"{prefix}_forward")
    forward_residual = getattr(k, f"{prefix}_forward_residual")
    backward, backward_add = getattr(k, f"{prefix}_backward"), getattr(k, f"{prefix}_backward_add")
    eps = NORM_EPS[prefix]
    rng = np.random.default_rng(n)
    x, w, dy = rand(rng, (n, D), dtype, 3.0), rand(rng, D, dtype), rand(rng, (n, D), dtype)
    y, rstd, dx, dw = np.empty_like(x), np.empty(n, dtype), np.empty_like(x), np.empty_like(w)
    forward(x, w, y, rstd)
    backward(x, w, rstd, dy, dx, dw)
    ty, tx_grad, tw_grad = rmsnorm_reference(x, w, dy, eps, UNIT_OFFSET[prefix])
    close(y, ty, dtype, "rmsnorm")
    close(dx, tx_grad, dtype, "rmsnorm")
    close(dw, tw_grad, dtype, "rmsnorm")
    close(rstd, torch.rsqrt(t(x).pow(2).mean(-1) + eps), dtype, "rmsnorm")
    # fused residual variant, in place on x
    r = rand(rng, (n, D), dtype)
    x_in = x.copy()
    y2, rstd2 = np.empty_like(x), np.empty(n, dtype)
    forward_residual(x_in, r, x_in, w, y2, rstd2)
    np.testing.assert_array_equal(x_in, x + r)
    forward(x + r, w, y, rstd)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(rstd2, rstd)
    # the accumulating backward adds the input gradient into what dx holds (rounding the sum once),
    # and writes dw
    forward(x, w, y, rstd)
    stream = rand(rng, (n, D), dtype)
    dx_added, dw_added = stream.copy(), np.full_like(w, np.nan)
    backward_add(x, w, rstd, dy, dx_added, dw_added)
    close(dx_added, stream + dx, dtype, "rmsnorm")
    np.testing.assert_array_equal(dw_added, dw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm(k, dtype, n, bias):
    prefix = "layer_norm" if bias else "layer_norm_unbiased"
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    backward_add = getattr(k, f"{prefix}_backward_add")
    rng = np.random.default_rng(n)
    x, w, b = rand(rng, (n, D), dtype, 3.0) + 2.0, rand(rng, D, dtype), rand(rng, D, dtype)
    dy = rand(rng, (n, D), dtype)
    y, mean, rstd = np.empty_like(x), np.empty(n, dtype), np.empty(n, dtype)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    forward(x, w, b, y, mean, rstd) if bias else forward(x, w, y, mean, rstd)
    backward(x, w, mean, rstd, dy, dx, dw, db) if bias else backward(x, w, mean, rstd, dy, dx, dw)
    tx, tw, tb = t(x, True), t(w, True), t(b, True)
    ty = F.layer_norm(tx, (D,), tw, tb if bias else None, 1e-5)
    ty.backward(t(dy))
    for ours, theirs in ((y, ty), (dx, tx.grad), (dw, tw.grad), (mean, tx.mean(-1))):
        close(ours, theirs, dtype, "layernorm")
    if bias:
        close(db, tb.grad, dtype, "layernorm")
    close(rstd, torch.rsqrt(tx.var(-1, unbiased=False) + 1e-5), dtype, "layernorm")
    # the accumulating backward adds the input gradient into what dx holds, and writes dw
    stream = rand(rng, (n, D), dtype)
    dx_added, dw_added = stream.copy(), np.full_like(w, np.nan)
    if bias:
        backward_add(x, w, mean, rstd, dy, dx_added, dw_added, np.empty_like(b))
    else:
        backward_add(x, w, mean, rstd, dy, dx_added, dw_added)
    close(dx_added, stream + dx, dtype, "layernorm")
    np.testing.assert_array_equal(dw_added, dw)


def fused_qkv_views(buffer):
    """The q, k, v views (N, heads, head_dim) of a fused (N, (H + 2 KV) * head_dim) buffer, as the
    planner hands them to the QK-norm: last axis contiguous, row stride that of the whole buffer.
    (Reshaped whole, then sliced: that also makes views of a CUDA device array.)"""
    heads = buffer.reshape(buffer.shape[0], H + 2 * KV, HD)
    q, k_, v = heads[:, :H], heads[:, H : H + KV], heads[:, H + KV :]
    assert all(np.shares_memory(a, buffer) for a in (q, k_, v))
    return q, k_, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize(("prefix", "view"), [("q_norm", 0), ("k_norm", 1)])
def test_head_rmsnorm(k, dtype, n, prefix, view):
    # QK-norm: an RMSNorm of each head's features with one shared gain, on strided views of a fused
    # q/k/v buffer; q_norm has gain w (Qwen3), k_norm 1 + w (Gemma 3)
    forward, backward = getattr(k, f"{prefix}_forward"), getattr(k, f"{prefix}_backward")
    eps, unit_offset = NORM_EPS[prefix], UNIT_OFFSET[prefix]
    rng = np.random.default_rng(n)
    width = (H + 2 * KV) * HD
    qkv, dqkv = rand(rng, (n, width), dtype, 3.0), rand(rng, (n, width), dtype)
    x, dy = fused_qkv_views(qkv)[view], fused_qkv_views(dqkv)[view]
    heads = x.shape[1]
    w = rand(rng, HD, dtype)
    # outputs are views into other fused buffers; what lies outside the view must stay untouched
    y_buffer, dx_buffer = np.full((n, width), np.nan, dtype), np.full((n, width), np.nan, dtype)
    y, dx = fused_qkv_views(y_buffer)[view], fused_qkv_views(dx_buffer)[view]
    rstd, dw = np.full((n, heads), np.nan, dtype), np.full(HD, np.nan, dtype)
    forward(x, w, y, rstd)
    backward(x, w, rstd, dy, dx, dw)
    ty, tx_grad, tw_grad = rmsnorm_reference(np.ascontiguousarray(x), w, np.ascontiguousarray(dy),
                                             eps, unit_offset)
    close(y, ty, dtype, "rmsnorm")
    close(dx, tx_grad, dtype, "rmsnorm")
    close(dw, tw_grad, dtype, "rmsnorm")
    close(rstd, torch.rsqrt(t(x).pow(2).mean(-1) + eps), dtype, "rmsnorm")
    inside = np.zeros((n, width), bool)
    fused_qkv_views(inside)[view][...] = True
    assert np.isnan(y_buffer[~inside]).all() and np.isnan(dx_buffer[~inside]).all()
    # in place: y over x, and dx over dy (as a fused buffer's gradient is normalised in place), on
    # views of the same strides (the float64 sums may be vectorized differently for other layouts)
    x_in, dy_in = fused_qkv_views(qkv.copy())[view], fused_qkv_views(dqkv.copy())[view]
    rstd_in = np.empty_like(rstd)
    forward(x_in, w, x_in, rstd_in)
    np.testing.assert_array_equal(x_in, y)
    np.testing.assert_array_equal(rstd_in, rstd)
    dw_in = np.empty_like(dw)
    backward(x, w, rstd, dy_in, dy_in, dw_in)
    np.testing.assert_array_equal(dy_in, dx)
    np.testing.assert_array_equal(dw_in, dw)


def hf_rope(dtype, theta):
    config = LlamaConfig(
        hidden_size=H * HD,
        num_attention_heads=H,
        num_key_value_heads=KV,
        max_position_embeddings=MAX_SEQ,
        rope_theta=theta,
    )
    assert config.rope_parameters["rope_theta"] == theta  # the reference really uses this base
    return LlamaRotaryEmbedding(config).to(getattr(torch, np.dtype(dtype).name))


@pytest.mark.parametrize("prefix", ROPE_THETAS)
def test_float32_rope_tables_match_transformers(k, prefix):
    # inv_freq and the arguments are bit-exact; torch's float32 cos/sin (SLEEF, 1 ulp) are not
    # correctly rounded, ours are: they differ by at most 1 float32 ulp. Two bases (50000, 10000).
    cos, sin = np.empty((MAX_SEQ, HD // 2), np.float32), np.empty((MAX_SEQ, HD // 2), np.float32)
    getattr(k, f"{prefix}_tables")(cos, sin)
    x = torch.zeros(1, MAX_SEQ, HD, dtype=torch.float32)
    hf_cos, hf_sin = hf_rope(np.float32, ROPE_THETAS[prefix])(x, torch.arange(MAX_SEQ)[None])
    for ours, theirs in [(cos, hf_cos), (sin, hf_sin)]:
        theirs = theirs[0, :, : HD // 2].numpy()
        np.testing.assert_array_max_ulp(ours, theirs, 1)
        assert np.mean(ours == theirs) > 0.8
    np.testing.assert_array_equal(hf_cos[0, :, : HD // 2], hf_cos[0, :, HD // 2 :])


@pytest.mark.parametrize("prefix", ROPE_THETAS)
def test_float64_rope_tables_are_float64_angles(k, prefix):
    # transformers would give float32 values even here; a float64 model keeps float64 precision
    cos, sin = np.empty((MAX_SEQ, HD // 2)), np.empty((MAX_SEQ, HD // 2))
    getattr(k, f"{prefix}_tables")(cos, sin)
    inv_freq = 1.0 / ROPE_THETAS[prefix] ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    angles = torch.arange(MAX_SEQ, dtype=torch.float64)[:, None] * inv_freq[None, :]
    np.testing.assert_allclose(cos, angles.cos().numpy(), rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(sin, angles.sin().numpy(), rtol=1e-15, atol=1e-15)


def packed_positions(rng, b, seq, packed):
    """(b, seq) positions of the tokens in their examples: 0..seq-1 per row, or with `packed`
    rows holding several examples from random starts (position 0 at each)."""
    positions = np.tile(np.arange(seq), (b, 1))
    if packed:
        for row in positions:
            for start in sorted(rng.choice(np.arange(1, seq), size=min(3, seq - 1), replace=False)):
                row[start:] = np.arange(seq - start)
    return positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "seq", "packed"), [(1, 1, False), (2, 5, False), (2, 9, True)])
def test_rope(k, dtype, b, seq, packed):
    rng = np.random.default_rng(seq)
    cos, sin = np.empty((MAX_SEQ, HD // 2), dtype), np.empty((MAX_SEQ, HD // 2), dtype)
    k.rope_tables(cos, sin)
    x, dy = rand(rng, (b, seq, H, HD), dtype), rand(rng, (b, seq, H, HD), dtype)
    positions = packed_positions(rng, b, seq, packed)
    y = x.copy()
    k.rope_forward(y, cos, sin, positions)
    tx = t(x, True)
    # transformers' rotation, fed our tables (which test_rope_tables_match_transformers compares)
    # at each token's position (position_ids, as transformers takes them for packed rows)
    full_cos = torch.cat([t(cos), t(cos)], -1)[torch.from_numpy(positions)]
    full_sin = torch.cat([t(sin), t(sin)], -1)[torch.from_numpy(positions)]
    ty, _ = apply_rotary_pos_emb(tx, tx, full_cos, full_sin, unsqueeze_dim=2)
    close(y, ty, dtype, "rope")
    ty.backward(t(dy))
    dx = dy.copy()
    k.rope_backward(dx, cos, sin, positions)
    close(dx, tx.grad, dtype, "rope")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", [0, 7, MAX_SEQ - 1])
def test_rope_decode(k, dtype, position):
    # one new token per sequence at `position`: the full rotation's row at that position
    rng = np.random.default_rng(position)
    cos, sin = np.empty((MAX_SEQ, HD // 2), dtype), np.empty((MAX_SEQ, HD // 2), dtype)
    k.rope_tables(cos, sin)
    x = rand(rng, (2, 1, H, HD), dtype)
    y, expected = x.copy(), x.copy()
    k.rope_decode(y, cos, sin, position)
    k.rope_forward(expected, cos, sin, np.full((2, 1), position))
    np.testing.assert_array_equal(y, expected)


def attention_mask(seq, window, positions=None):
    """allowed[b, t, j] (or [t, j] without positions): position t attends to j, written out:
    j <= t, with a window W > 0 also j > t - W (transformers' sliding_window_overlay: kv_idx >
    q_idx - sliding_window), and with `positions` (B, T) j in t's example: j >= t - positions[t]."""
    t_idx, j_idx = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = j_idx <= t_idx
    if window > 0:
        allowed &= j_idx > t_idx - window
    if positions is not None:
        example_start = torch.arange(seq)[None, :] - torch.from_numpy(positions)
        allowed = allowed[None] & (j_idx[None] >= example_start[:, :, None])
    return allowed


def torch_attention(q, k_, v, scale, window, positions):
    # q (B,T,H,hd), k, v (B,T,KV,hd) -> (B,T,H*hd), via SDPA with an explicit boolean mask
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k_, v))
    mask = attention_mask(q.shape[1], window, positions)[:, None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


# (B, T, window): global (0), windows shorter than T (1 is attention to itself only), equal to T
# and longer than T (both the global result)
# The kernels work in blocks of 4 rows and 4 columns: the cases cover every remainder of T by 4,
# windows that start inside a block and on its edge, and windows wider than T.
# Packed rows (several examples, random starts) with and without a window.
ATTENTION_CASES = [(1, 1, 0, False), (2, 5, 0, False), (1, 17, 0, False), (2, 5, 3, False),
                   (1, 17, 1, False), (1, 17, 4, False), (1, 17, 17, False), (2, 5, 9, False),
                   (1, 16, 0, False), (2, 14, 6, False), (1, 19, 5, False), (1, 12, 4, False),
                   (2, 23, 7, False), (2, 5, 0, True), (2, 17, 0, True), (1, 12, 4, True),
                   (2, 23, 7, True)]


def attention_inputs(rng, b, seq, dtype):
    q, kk, v = (
        rand(rng, (b, seq, H, HD), dtype),
        rand(rng, (b, seq, KV, HD), dtype),
        rand(rng, (b, seq, KV, HD), dtype),
    )
    return q, kk, v, rand(rng, (b, seq, H * HD), dtype)


def run_attention(k, prefix, q, kk, v, dout, window, positions=None):
    """(att, out, dq, dk, dv) of kernels `prefix` with `window` and `positions` (default: one
    sequence per row), every output starting as NaN."""
    b, seq = q.shape[:2]
    positions = np.tile(np.arange(seq), (b, 1)) if positions is None else positions
    att = np.full((b, H, seq, seq), np.nan, q.dtype)
    out = np.full((b, seq, H * HD), np.nan, q.dtype)
    dq, dk, dv = np.full_like(q, np.nan), np.full_like(kk, np.nan), np.full_like(v, np.nan)
    getattr(k, f"{prefix}_forward")(q, kk, v, att, out, window, positions)
    getattr(k, f"{prefix}_backward")(q, kk, v, att, dout, dq, dk, dv, window, positions)
    return att, out, dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "seq", "window", "packed"), ATTENTION_CASES)
@pytest.mark.parametrize("prefix", ATTENTION_SCALES)
def test_attention(k, dtype, b, seq, window, packed, prefix):
    # attn: scale 1/sqrt(head_dim); attn_scaled: another scale
    scale = ATTENTION_SCALES[prefix]
    rng = np.random.default_rng(seq)
    q, kk, v, dout = attention_inputs(rng, b, seq, dtype)
    positions = packed_positions(rng, b, seq, packed)
    att, out, dq, dk, dv = run_attention(k, prefix, q, kk, v, dout, window, positions)
    # torch in float64 on the same values: a float32 torch reference errs as much as we do
    wide = [a.astype(np.float64) for a in (q, kk, v, dout)]
    tq, tk, tv = t(wide[0], True), t(wide[1], True), t(wide[2], True)
    tout = torch_attention(tq, tk, tv, scale, window, positions)
    tout.backward(t(wide[3]))
    close(out, tout, dtype, "attention")
    close(dq, tq.grad, dtype, "attention")
    close(dk, tk.grad, dtype, "attention")
    close(dv, tv.grad, dtype, "attention")
    scores = torch.einsum("bthd,bjhd->bhtj", t(wide[0]), t(wide[1]).repeat_interleave(H // KV, 2)) * scale
    masked = scores.masked_fill(~attention_mask(seq, window, positions)[:, None], -torch.inf)
    close(att, masked.softmax(-1), dtype, "attention")
    if window >= seq:  # a window covering the whole sequence is global attention, bit for bit
        for ours, glob in zip((att, out, dq, dk, dv),
                              run_attention(k, prefix, q, kk, v, dout, 0, positions)):
            np.testing.assert_array_equal(ours, glob)
    if packed:  # each example of a packed row computes what it computes alone
        starts = [(row, start) for row in range(b) for start in np.flatnonzero(positions[row] == 0)]
        for row, start in starts:
            stop = start + 1
            while stop < seq and positions[row, stop]:
                stop += 1
            alone = run_attention(*(k, prefix), *(np.ascontiguousarray(a[row : row + 1, start:stop])
                                                 for a in (q, kk, v, dout)), window)
            packed_part = (att[row, :, start:stop, start:stop], out[row, start:stop],
                           dq[row, start:stop], dk[row, start:stop], dv[row, start:stop])
            for ours, theirs in zip(packed_part, alone):
                close(ours, theirs[0], dtype, "attention")
        return
    # decode: the last query against a cache of the positions it attends to equals the last row.
    # A sliding layer's cache is a ring buffer of its window (position p in slot p % W), so the
    # slots are not in position order; slots past n_valid must not be read.
    first = max(seq - window, 0) if window > 0 else 0
    slots = min(seq, window) if window > 0 else MAX_SEQ
    cache_k, cache_v = (np.full((b, slots, KV, HD), 1e3, dtype) for _ in range(2))
    for position in range(first, seq):
        slot = position % window if window > 0 else position
        cache_k[:, slot], cache_v[:, slot] = kk[:, position], v[:, position]
    dec = np.full((b, 1, H * HD), np.nan, dtype)
    q_last = np.ascontiguousarray(q[:, -1:])
    getattr(k, f"{prefix}_decode")(q_last, cache_k, cache_v, seq - first, dec)
    np.testing.assert_allclose(dec[:, 0], out[:, -1], **tol(dtype, "attention"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 6])
def test_attention_on_views_of_fused_rows(k, dtype, window):
    # the generated model passes q, k, v (and dq, dk, dv) as head slices of one fused qkv array:
    # the results must be those of contiguous arrays, bit for bit, and every gradient written
    b, seq = 2, 14
    rng = np.random.default_rng(7)
    qkv = rand(rng, (b, seq, H + 2 * KV, HD), dtype)
    q, kk, v = qkv[:, :, :H], qkv[:, :, H : H + KV], qkv[:, :, H + KV :]
    dout = rand(rng, (b, seq, H * HD), dtype)
    att = np.full((b, H, seq, seq), np.nan, dtype)
    out = np.full((b, seq, H * HD), np.nan, dtype)
    dqkv = np.full_like(qkv, np.nan)
    dq, dk, dv = dqkv[:, :, :H], dqkv[:, :, H : H + KV], dqkv[:, :, H + KV :]
    positions = np.tile(np.arange(seq), (b, 1))
    k.attn_forward(q, kk, v, att, out, window, positions)
    k.attn_backward(q, kk, v, att, dout, dq, dk, dv, window, positions)
    contiguous = [np.ascontiguousarray(a) for a in (q, kk, v, dout)]
    expected = run_attention(k, "attn", *contiguous, window)
    for ours, theirs in zip((att, out, dq, dk, dv), expected):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_swiglu(k, dtype, n):
    rng = np.random.default_rng(n)
    gate_up, dh = rand(rng, (n, 2 * HIDDEN), dtype, 4.0), rand(rng, (n, HIDDEN), dtype, 4.0)
    h, dgate_up = np.empty_like(dh), np.empty_like(gate_up)
    k.mlp_forward(gate_up, h)
    k.mlp_backward(gate_up, dh, dgate_up)
    tg, tu = t(gate_up[:, :HIDDEN], True), t(gate_up[:, HIDDEN:], True)
    th = F.silu(tg) * tu
    th.backward(t(dh))
    close(h, th, dtype, "elementwise")
    close(dgate_up[:, :HIDDEN], tg.grad, dtype, "elementwise")
    close(dgate_up[:, HIDDEN:], tu.grad, dtype, "elementwise")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_geglu(k, dtype, n):
    # against transformers' gelu_pytorch_tanh (Gemma's hidden_activation): torch's tanh GELU. For
    # float32 inputs the reference runs in float64: torch's float32 backward loses up to 2e-5
    # relative to it (its 1 - tanh² cancels), ours stays within the float32 tolerance of it.
    rng = np.random.default_rng(n)
    gate_up, dh = rand(rng, (n, 2 * HIDDEN), dtype, 4.0), rand(rng, (n, HIDDEN), dtype, 4.0)
    gate_up[0, :4] = [0.0, -100.0, 100.0, -9.0]  # 0, saturation on both sides, the far tail
    h, dgate_up = np.empty_like(dh), np.empty_like(gate_up)
    k.geglu_forward(gate_up, h)
    k.geglu_backward(gate_up, dh, dgate_up)
    gate_up, dh = gate_up.astype(np.float64), dh.astype(np.float64)  # exact
    tg, tu = t(gate_up[:, :HIDDEN], True), t(gate_up[:, HIDDEN:], True)
    th = ACT2FN["gelu_pytorch_tanh"](tg) * tu
    th.backward(t(dh))
    close(h, th, dtype, "elementwise")
    close(dgate_up[:, :HIDDEN], tg.grad, dtype, "elementwise")
    close(dgate_up[:, HIDDEN:], tu.grad, dtype, "elementwise")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu", "relu"])
def test_activation(k, dtype, kind):
    rng = np.random.default_rng(0)
    x, dy = rand(rng, (7, 3, HIDDEN), dtype, 4.0), rand(rng, (7, 3, HIDDEN), dtype)
    x[0, 0, :3] = [0.0, -100.0, 100.0]  # the edges: relu's kink, exp overflow in the sigmoid
    y, dx = np.empty_like(x), np.empty_like(x)
    getattr(k, f"{kind}_forward")(x, y)
    getattr(k, f"{kind}_backward")(x, dy, dx)
    tx = t(x, True)
    ty = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[kind](tx)
    ty.backward(t(dy))
    close(y, ty, dtype, "elementwise")
    close(dx, tx.grad, dtype, "elementwise")


# inputs of every magnitude, for the slopes: random inputs of order 1 cannot see a slope that a large
# input rounds away (the fuzzer found SiLU's, written sig + silu - silu sig: 0 instead of 1 for
# float64 gates past 2^53, which a spec whose residual stream grows as x^8 per block reaches).
# Float32 goes to 1e8 only: its exp is clamped to [-87, 88] (vector_math), so gelu_tanh's slope,
# x s (1 - s) dz/dx with dz/dx of order x², reads the clamped tail past |x| of about 1e12.
MAGNITUDES = {np.float64: np.logspace(-3, 100, 207), np.float32: np.logspace(-3, 8, 45)}
SLOPE_REFERENCES = {
    "silu": F.silu,
    "gelu": F.gelu,
    "mlp": F.silu,  # the SwiGLU's gate
    "geglu": ACT2FN["gelu_pytorch_tanh"],
}


def every_magnitude(dtype, multiple):
    m = MAGNITUDES[dtype]
    x = np.concatenate([-m[::-1], [0.0], m])
    return np.concatenate([x, np.zeros(-x.size % multiple)]).astype(dtype).reshape(-1, multiple)


def torch_slope(kind, x):
    tx = t(x.astype(np.float64), True)  # float32 inputs are exact in float64
    SLOPE_REFERENCES[kind](tx).sum().backward()
    return tx.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu"])
def test_activation_slope_at_every_magnitude(k, dtype, kind):
    x = every_magnitude(dtype, 1)
    dx = np.empty_like(x)
    getattr(k, f"{kind}_backward")(x, np.ones_like(x), dx)
    close(dx, torch_slope(kind, x), dtype, "elementwise")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["mlp", "geglu"])  # SwiGLU, GeGLU
def test_gate_slope_at_every_magnitude(k, dtype, kind):
    # ups of 1 and dh of 1, so that the gate's gradient is the activation's slope
    gates = every_magnitude(dtype, HIDDEN)
    gate_up = np.concatenate([gates, np.ones_like(gates)], axis=1)
    dgate_up = np.empty_like(gate_up)
    getattr(k, f"{kind}_backward")(gate_up, np.ones_like(gates), dgate_up)
    close(dgate_up[:, :HIDDEN], torch_slope(kind, gates), dtype, "elementwise")


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual(k, dtype):
    rng = np.random.default_rng(0)
    x, r, dout, dx = (rand(rng, (3, 5, D), dtype) for _ in range(4))
    out = np.empty_like(x)
    k.residual_add(x, r, out)
    np.testing.assert_array_equal(out, x + r)
    in_place = x.copy()
    k.residual_add(in_place, r, in_place)
    np.testing.assert_array_equal(in_place, x + r)
    acc = dx.copy()
    k.add_into(acc, dout)
    np.testing.assert_array_equal(acc, dx + dout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS + [130])
@pytest.mark.parametrize("in_place", [False, True])
def test_cross_entropy(k, dtype, n, in_place):
    rng = np.random.default_rng(n)
    logits = rand(rng, (n, C), dtype, 5.0)
    targets = rng.integers(0, C, n).astype(np.int64)
    if n > 1:
        targets[::3] = -100
    tl = t(logits, True)
    tloss = F.cross_entropy(tl, torch.tensor(targets), ignore_index=-100)
    tloss.backward()
    loss_only = k.ce_forward(logits, targets)
    dlogits = logits if in_place else np.full_like(logits, np.nan)
    loss = k.ce_forward_backward(logits, targets, dlogits)
    assert isinstance(loss, float) and isinstance(loss_only, float)
    close(loss, tloss, dtype, "cross_entropy")
    assert loss == loss_only
    close(dlogits, tl.grad, dtype, "cross_entropy")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS + [130])
def test_weighted_cross_entropy_and_target_log_probs(k, dtype, n):
    """A preference loss's backward: each row's cross-entropy gradient times its own weight
    (token_weights), the gradient of sum_n w_n CE_n; and each target's log-probability, which is
    what the weights are computed from."""
    rng = np.random.default_rng(n)
    logits = rand(rng, (n, C), dtype, 5.0)
    targets = rng.integers(0, C, n).astype(np.int64)
    if n > 1:
        targets[::3] = -100
    weights = rng.normal(0.0, 1.0, n)
    tl = t(logits, True)
    row_losses = F.cross_entropy(tl, torch.tensor(targets), ignore_index=-100, reduction="none")
    (row_losses * torch.tensor(weights, dtype=tl.dtype)).sum().backward()
    log_probs = np.full(n, np.nan)
    k.target_log_probs(logits, targets, log_probs)
    close(log_probs, -row_losses.detach(), dtype, "cross_entropy")
    assert (log_probs[targets == -100] == 0).all()
    dlogits = np.full_like(logits, np.nan)
    k.ce_forward_backward(logits, targets, dlogits, token_weights=weights)
    close(dlogits, tl.grad, dtype, "cross_entropy")
    # the weights 1 / n_valid are the mean's, bit for bit
    uniform = np.full_like(logits, np.nan)
    k.ce_forward_backward(logits, targets, uniform, token_weights=np.full(n, 1.0 / max(1, (targets != -100).sum())))
    mean = np.full_like(logits, np.nan)
    k.ce_forward_backward(logits, targets, mean)
    np.testing.assert_array_equal(uniform, mean)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lr", "weight_decay"), [(1e-3, 0.0), (3e-2, 0.1), (0.5, 0.01)])
def test_adamw(k, dtype, lr, weight_decay):
    rng = np.random.default_rng(1)
    n = 1000
    params = rand(rng, n, dtype)
    exp_avg, exp_avg_sq = np.zeros(n, dtype), np.zeros(n, dtype)
    tp = torch.nn.Parameter(t(params.copy()))
    opt = torch.optim.AdamW([tp], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    for step in range(1, 11):
        grads = rand(rng, n, dtype)
        tp.grad = t(grads)
        opt.step()
        k.adamw_step(params, grads, exp_avg, exp_avg_sq, lr, 0.9, 0.95, 1e-8, weight_decay, step)
    rtol, atol = (1e-12, 1e-15) if dtype == np.float64 else FLOAT32_TOL["adamw"]
    np.testing.assert_allclose(params, tp.detach().numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(exp_avg, opt.state[tp]["exp_avg"].numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(
        exp_avg_sq, opt.state[tp]["exp_avg_sq"].numpy(), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_norm_and_scale(k, dtype):
    rng = np.random.default_rng(2)
    grads = rand(rng, 1001, dtype)
    norm = k.adamw_grad_norm(grads)
    assert isinstance(norm, float)
    np.testing.assert_allclose(norm, np.linalg.norm(grads.astype(np.float64)), rtol=1e-14)
    scaled = grads.copy()
    k.adamw_scale(scaled, 0.25)
    np.testing.assert_array_equal(scaled, grads * dtype(0.25))
