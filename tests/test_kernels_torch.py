"""Every CPU kernel, forward and backward, against PyTorch autograd (and transformers for Llama parts).

float64: rtol 1e-10, atol 1e-12. float32: the per-op tolerances in FLOAT32_TOL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_harness import DIMS, all_blocks, load
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

D, HIDDEN, V = DIMS["dim"], DIMS["hidden"], DIMS["vocab"]
H, KV, HD, C = DIMS["n_heads"], DIMS["n_kv_heads"], DIMS["head_dim"], DIMS["classes"]
MAX_SEQ = 32

# float32 (rtol, atol) per op: our kernels accumulate row sums in float64 where torch sums in
# float32, so results differ by a few float32 ulps of the largest term (unit roundoff 6e-8).
FLOAT32_TOL = {
    "linear": (1e-5, 1e-5),  # BLAS sums of 24-40 products; summation order differs from torch's
    "embedding": (0, 0),  # a gather is exact; the scatter-add sums in the same row order
    "rmsnorm": (1e-5, 1e-6),
    "rope": (1e-6, 1e-6),  # one rotation: 2 products and a sum per output
    "attention": (1e-5, 1e-6),
    # silu, gelu, relu, swiglu, residual: gelu evaluates in float64 and rounds once, silu and swiglu
    # use a float32 exp within 1 ulp; torch rounds each intermediate; inputs reach |x| ~ 16, so the
    # absolute error is a few ulps of 16
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_embedding(k, dtype, n):
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 5, n).astype(np.int64)  # few distinct ids, so rows repeat
    table, dout = rand(rng, (V, D), dtype), rand(rng, (n, D), dtype)
    prior = rand(rng, (V, D), dtype)  # the backward accumulates into what dtable already holds
    out, dtable = np.empty((n, D), dtype), prior.copy()
    k.tok_forward(ids, table, out)
    k.tok_backward(ids, dout, dtable)
    tt = t(table, True)
    to = F.embedding(torch.tensor(ids), tt)
    to.backward(t(dout))
    close(out, to, dtype, "embedding")
    np.testing.assert_allclose(dtable, prior + tt.grad.numpy(), **tol(dtype, "linear"))
    with pytest.raises(ValueError):
        k.tok_forward(np.array([V], np.int64), table, out[:1])


def torch_rmsnorm(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_rmsnorm(k, dtype, n):
    rng = np.random.default_rng(n)
    x, w, dy = rand(rng, (n, D), dtype, 3.0), rand(rng, D, dtype), rand(rng, (n, D), dtype)
    y, rstd, dx, dw = np.empty_like(x), np.empty(n, dtype), np.empty_like(x), np.empty_like(w)
    k.norm_forward(x, w, y, rstd)
    k.norm_backward(x, w, rstd, dy, dx, dw)
    tx, tw = t(x, True), t(w, True)
    if dtype == np.float32:  # transformers' own module (it computes in float32 for any dtype)
        module = LlamaRMSNorm(D, eps=1e-5)
        with torch.no_grad():
            module.weight.copy_(tw)
        ty = module(tx)
        ty.backward(t(dy))
        tw_grad = module.weight.grad
    else:
        ty = torch_rmsnorm(tx, tw)
        ty.backward(t(dy))
        tw_grad = tw.grad
    close(y, ty, dtype, "rmsnorm")
    close(dx, tx.grad, dtype, "rmsnorm")
    close(dw, tw_grad, dtype, "rmsnorm")
    close(rstd, torch.rsqrt(t(x).pow(2).mean(-1) + 1e-5), dtype, "rmsnorm")
    # fused residual variant, in place on x
    r = rand(rng, (n, D), dtype)
    x_in = x.copy()
    y2, rstd2 = np.empty_like(x), np.empty(n, dtype)
    k.norm_forward_residual(x_in, r, x_in, w, y2, rstd2)
    np.testing.assert_array_equal(x_in, x + r)
    k.norm_forward(x + r, w, y, rstd)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(rstd2, rstd)
    # the accumulating backward adds the input gradient into what dx holds (rounding the sum once),
    # and writes dw
    k.norm_forward(x, w, y, rstd)
    stream = rand(rng, (n, D), dtype)
    dx_added, dw_added = stream.copy(), np.full_like(w, np.nan)
    k.norm_backward_add(x, w, rstd, dy, dx_added, dw_added)
    close(dx_added, stream + dx, dtype, "rmsnorm")
    np.testing.assert_array_equal(dw_added, dw)


def hf_rope(dtype):
    config = LlamaConfig(
        hidden_size=H * HD,
        num_attention_heads=H,
        num_key_value_heads=KV,
        max_position_embeddings=MAX_SEQ,
        rope_theta=10000.0,
    )
    return LlamaRotaryEmbedding(config).to(getattr(torch, np.dtype(dtype).name))


def test_float32_rope_tables_match_transformers(k):
    # inv_freq and the arguments are bit-exact; torch's float32 cos/sin (SLEEF, 1 ulp) are not
    # correctly rounded, ours are: they differ by at most 1 float32 ulp.
    cos, sin = np.empty((MAX_SEQ, HD // 2), np.float32), np.empty((MAX_SEQ, HD // 2), np.float32)
    k.rope_tables(cos, sin)
    x = torch.zeros(1, MAX_SEQ, HD, dtype=torch.float32)
    hf_cos, hf_sin = hf_rope(np.float32)(x, torch.arange(MAX_SEQ)[None])
    for ours, theirs in [(cos, hf_cos), (sin, hf_sin)]:
        theirs = theirs[0, :, : HD // 2].numpy()
        np.testing.assert_array_max_ulp(ours, theirs, 1)
        assert np.mean(ours == theirs) > 0.8
    np.testing.assert_array_equal(hf_cos[0, :, : HD // 2], hf_cos[0, :, HD // 2 :])


def test_float64_rope_tables_are_float64_angles(k):
    # transformers would give float32 values even here; a float64 model keeps float64 precision
    cos, sin = np.empty((MAX_SEQ, HD // 2)), np.empty((MAX_SEQ, HD // 2))
    k.rope_tables(cos, sin)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    angles = torch.arange(MAX_SEQ, dtype=torch.float64)[:, None] * inv_freq[None, :]
    np.testing.assert_allclose(cos, angles.cos().numpy(), rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(sin, angles.sin().numpy(), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "seq", "offset"), [(1, 1, 0), (2, 5, 0), (1, 3, 7)])
def test_rope(k, dtype, b, seq, offset):
    rng = np.random.default_rng(seq)
    cos, sin = np.empty((MAX_SEQ, HD // 2), dtype), np.empty((MAX_SEQ, HD // 2), dtype)
    k.rope_tables(cos, sin)
    x, dy = rand(rng, (b, seq, H, HD), dtype), rand(rng, (b, seq, H, HD), dtype)
    y = x.copy()
    k.rope_forward(y, cos, sin, offset)
    positions = torch.arange(offset, offset + seq)[None].expand(b, seq)
    tx = t(x, True)
    # transformers' rotation, fed our tables (which test_rope_tables_match_transformers compares)
    full_cos = torch.cat([t(cos), t(cos)], -1)[positions]
    full_sin = torch.cat([t(sin), t(sin)], -1)[positions]
    ty, _ = apply_rotary_pos_emb(tx, tx, full_cos, full_sin, unsqueeze_dim=2)
    close(y, ty, dtype, "rope")
    if offset == 0:
        ty.backward(t(dy))
        dx = dy.copy()
        k.rope_backward(dx, cos, sin)
        close(dx, tx.grad, dtype, "rope")


def torch_attention(q, k_, v):
    # q (B,T,H,hd), k, v (B,T,KV,hd) -> (B,T,H*hd), via repeat_interleave and SDPA
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k_, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "seq"), [(1, 1), (2, 5), (1, 17)])
def test_attention(k, dtype, b, seq):
    rng = np.random.default_rng(seq)
    q, kk, v = (
        rand(rng, (b, seq, H, HD), dtype),
        rand(rng, (b, seq, KV, HD), dtype),
        rand(rng, (b, seq, KV, HD), dtype),
    )
    dout = rand(rng, (b, seq, H * HD), dtype)
    att, out = np.full((b, H, seq, seq), np.nan, dtype), np.full((b, seq, H * HD), np.nan, dtype)
    dq, dk, dv = np.full_like(q, np.nan), np.full_like(kk, np.nan), np.full_like(v, np.nan)
    k.attn_forward(q, kk, v, att, out)
    k.attn_backward(q, kk, v, att, dout, dq, dk, dv)
    tq, tk, tv = t(q, True), t(kk, True), t(v, True)
    tout = torch_attention(tq, tk, tv)
    tout.backward(t(dout))
    close(out, tout, dtype, "attention")
    close(dq, tq.grad, dtype, "attention")
    close(dk, tk.grad, dtype, "attention")
    close(dv, tv.grad, dtype, "attention")
    scores = torch.einsum("bthd,bjhd->bhtj", t(q), t(kk).repeat_interleave(H // KV, 2)) / HD**0.5
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    close(att, scores.masked_fill(mask, -torch.inf).softmax(-1), dtype, "attention")
    # decode: the last query against a cache holding every position equals the last row
    cache_k, cache_v = np.zeros((b, MAX_SEQ, KV, HD), dtype), np.zeros((b, MAX_SEQ, KV, HD), dtype)
    cache_k[:, :seq], cache_v[:, :seq] = kk, v
    cache_k[:, seq:], cache_v[:, seq:] = 1e3, 1e3  # positions past `length` must not be read
    dec = np.full((b, 1, H * HD), np.nan, dtype)
    k.attn_decode(np.ascontiguousarray(q[:, -1:]), cache_k, cache_v, seq, dec)
    np.testing.assert_allclose(dec[:, 0], out[:, -1], **tol(dtype, "attention"))


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual(k, dtype):
    rng = np.random.default_rng(0)
    x, r, dout, dx = (rand(rng, (3, 5, D), dtype) for _ in range(4))
    out = np.empty_like(x)
    k.res_forward(x, r, out)
    np.testing.assert_array_equal(out, x + r)
    in_place = x.copy()
    k.res_forward(in_place, r, in_place)
    np.testing.assert_array_equal(in_place, x + r)
    acc = dx.copy()
    k.res_backward(dout, acc)
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
        k.opt_step(params, grads, exp_avg, exp_avg_sq, lr, 0.9, 0.95, 1e-8, weight_decay, step)
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
    norm = k.opt_grad_norm(grads)
    assert isinstance(norm, float)
    np.testing.assert_allclose(norm, np.linalg.norm(grads.astype(np.float64)), rtol=1e-14)
    scaled = grads.copy()
    k.opt_scale(scaled, 0.25)
    np.testing.assert_array_equal(scaled, grads * dtype(0.25))
