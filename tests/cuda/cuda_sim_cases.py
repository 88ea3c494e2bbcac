"""CUDA kernels against the CPU kernels, in float64 and float32, under Numba's CUDA simulator or on
a GPU (the switch of tests/support/cuda_target.py).

float64: rtol 1e-12, atol 1e-14. float32 (the models' default dtype): the tolerances in TOL, a few
float32 ulps, since the two targets round differently (the CPU sums in float64 or through BLAS and
uses a float32 polynomial exp; the simulator evaluates each kernel's Python with NumPy scalars; a
GPU contracts multiply-adds into FMAs, and cuBLAS sums in its own order).

Not collected directly (the name does not start with test_): tests/cuda/test_cuda_sim.py runs
this file in a child pytest process, because NUMBA_ENABLE_CUDASIM only takes effect if it is set
before numba.cuda is first imported, and pytest imports every test module of a session before
running any.
"""

from __future__ import annotations

# isort: off
from tests.support.cuda_target import SIMULATED, check_target, kernel_is_targets  # first: sets the target
# isort: on

import numpy as np
import pytest
from numba import cuda

from tests.support.kernel_harness import (
    ATTENTION_SCALES,
    DIMS,
    EMBEDDING_SCALES,
    all_blocks,
    load,
)

D, HIDDEN, V = DIMS["dim"], DIMS["hidden"], DIMS["vocab"]
H, KV, HD, C = DIMS["n_heads"], DIMS["n_kv_heads"], DIMS["head_dim"], DIMS["classes"]
MAX_SEQ = 32
DTYPES = [np.float64, np.float32]
TOL = {
    np.float64: dict(rtol=1e-12, atol=1e-14),
    # inputs of order 1-10, outputs summing up to 40 products: a few ulps of float32 (6e-8)
    np.float32: dict(rtol=2e-6, atol=2e-6),
}


@pytest.fixture(scope="module")
def cpu():
    return load("cpu", all_blocks("cpu"))


@pytest.fixture(scope="module")
def gpu():
    module = load("cuda", all_blocks("cuda"))
    # what runs is the target asked for: numba read the variable when numba.cuda was first
    # imported, and the kernels are the simulator's or, on a GPU, numba's CUDA dispatchers
    check_target()
    from pyml.package.cuda import rmsnorm

    assert kernel_is_targets(rmsnorm.forward_kernel)
    return module


def run_both(cpu_fn, gpu_fn, *arrays, scalars=()):
    """Call both kernels on copies of `arrays` (+ scalars); return (cpu arrays, gpu arrays, results)."""
    host = [a.copy() for a in arrays]
    dev = [cuda.to_device(a.copy()) for a in arrays]
    r_cpu = cpu_fn(*host, *scalars)
    r_gpu = gpu_fn(*dev, *scalars)
    return host, [d.copy_to_host() for d in dev], (r_cpu, r_gpu)


def same(host, dev):
    for a, b in zip(host, dev, strict=True):
        if np.issubdtype(a.dtype, np.integer):  # token ids and targets, passed through
            np.testing.assert_array_equal(b, a)
        else:
            np.testing.assert_allclose(b, a, **TOL[a.dtype.type])


def rand(rng, dtype, *shape):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear(cpu, gpu, dtype, bias, product_route):
    check_linear(cpu, gpu, dtype, bias)


class NumpyAsCupy:
    """The two CuPy calls of the cuBLAS route (pyml/package/cuda_products.py) over the simulator's
    device arrays, which hold a numpy array (`_ary`) as their memory: so that where no GPU is, the
    route's layouts, transposes and output are still held to the CPU's products."""

    @staticmethod
    def asarray(device_array):
        return device_array._ary

    matmul = staticmethod(np.matmul)


@pytest.mark.skipif(not SIMULATED, reason="on a GPU, test_linear runs the route on CuPy itself")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_through_the_cublas_routes_layouts(cpu, gpu, dtype, bias, monkeypatch):
    from pyml.package import cuda_products

    monkeypatch.setattr(cuda_products, "cupy_module", lambda simulated: NumpyAsCupy)
    monkeypatch.setenv(cuda_products.SWITCH, "cublas")
    check_linear(cpu, gpu, dtype, bias)


def check_linear(cpu, gpu, dtype, bias):
    rng = np.random.default_rng(0)
    n = 5
    x, w, b = rand(rng, dtype, n, D), rand(rng, dtype, HIDDEN, D), rand(rng, dtype, HIDDEN)
    dy = rand(rng, dtype, n, HIDDEN)
    y, dx, dw, db = (np.zeros(a.shape, dtype) for a in (dy, x, w, b))
    if bias:
        same(*run_both(cpu.fc_bias_forward, gpu.fc_bias_forward, x, w, b, y)[:2])
        same(*run_both(cpu.fc_bias_backward, gpu.fc_bias_backward, x, w, dy, dx, dw, db)[:2])
    else:
        same(*run_both(cpu.fc_forward, gpu.fc_forward, x, w, y)[:2])
        same(*run_both(cpu.fc_backward, gpu.fc_backward, x, w, dy, dx, dw)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", EMBEDDING_SCALES)  # no scale, and sqrt(dim)
def test_embedding(cpu, gpu, dtype, prefix):
    forward = [getattr(m, f"{prefix}_forward") for m in (cpu, gpu)]
    backward = [getattr(m, f"{prefix}_backward") for m in (cpu, gpu)]
    rng = np.random.default_rng(1)
    ids = np.array([3, 0, 3, 7, 3], np.int64)
    table, dout, dtable = rand(rng, dtype, V, D), rand(rng, dtype, 5, D), rand(rng, dtype, V, D)
    same(*run_both(*forward, ids, table, np.zeros((5, D), dtype))[:2])
    same(*run_both(*backward, ids, dout, dtable)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", ["norm", "norm_offset"])  # gain w, gain 1 + w
def test_rmsnorm(cpu, gpu, dtype, prefix):
    def both(name):
        return [getattr(m, f"{prefix}_{name}") for m in (cpu, gpu)]

    rng = np.random.default_rng(2)
    x, w, dy = rand(rng, dtype, 3, D), rand(rng, dtype, D), rand(rng, dtype, 3, D)
    host, dev, _ = run_both(*both("forward"), x, w, np.zeros((3, D), dtype), np.zeros(3, dtype))
    same(host, dev)
    rstd = host[3]
    grads = np.zeros((3, D), dtype), np.zeros(D, dtype)
    same(*run_both(*both("backward"), x, w, rstd, dy, *grads)[:2])
    stream, r = rand(rng, dtype, 3, D), rand(rng, dtype, 3, D)
    same(*run_both(*both("backward_add"), x, w, rstd, dy, stream, np.zeros(D, dtype))[:2])
    outputs = np.zeros((3, D), dtype), w, np.zeros((3, D), dtype), np.zeros(3, dtype)
    same(*run_both(*both("forward_residual"), x, r, *outputs)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm(cpu, gpu, dtype):
    def both(name):
        return [getattr(m, f"layer_norm_{name}") for m in (cpu, gpu)]

    rng = np.random.default_rng(5)
    x, w, b, dy = rand(rng, dtype, 3, D), rand(rng, dtype, D), rand(rng, dtype, D), rand(rng, dtype, 3, D)
    stats = np.zeros(3, dtype), np.zeros(3, dtype)
    host, dev, _ = run_both(*both("forward"), x, w, b, np.zeros((3, D), dtype), *stats)
    same(host, dev)
    mean, rstd = host[4], host[5]
    grads = np.zeros((3, D), dtype), np.zeros(D, dtype), np.zeros(D, dtype)
    same(*run_both(*both("backward"), x, w, mean, rstd, dy, *grads)[:2])
    stream = rand(rng, dtype, 3, D)
    same(*run_both(*both("backward_add"), x, w, mean, rstd, dy, stream, *grads[1:])[:2])


def head_views(buffer, view):
    # view 0: the q heads, 1: the k heads of a fused (N, (H + 2 KV) * head_dim) buffer (host or device)
    heads = buffer.reshape(buffer.shape[0], H + 2 * KV, HD)
    return heads[:, :H] if view == 0 else heads[:, H : H + KV]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("prefix", "view"), [("q_norm", 0), ("k_norm", 1)])
def test_head_rmsnorm(cpu, gpu, dtype, prefix, view):
    # on strided views of fused buffers, on both targets; the backward in place over dy
    rng = np.random.default_rng(9)
    n, width = 3, (H + 2 * KV) * HD
    heads = H if view == 0 else KV
    qkv, dqkv, w = rand(rng, dtype, n, width), rand(rng, dtype, n, width), rand(rng, dtype, HD)
    results = []
    for module, to_device in ((cpu, np.copy), (gpu, cuda.to_device)):
        x_buffer, y_buffer, dy_buffer = (to_device(a) for a in (qkv, np.zeros_like(qkv), dqkv))
        rstd, dw = to_device(np.zeros((n, heads), dtype)), to_device(np.zeros(HD, dtype))
        x, y, dy = (head_views(a, view) for a in (x_buffer, y_buffer, dy_buffer))
        getattr(module, f"{prefix}_forward")(x, w, y, rstd)
        getattr(module, f"{prefix}_backward")(x, w, rstd, dy, dy, dw)
        results.append([np.asarray(a) if module is cpu else a.copy_to_host()
                        for a in (y_buffer, rstd, dy_buffer, dw)])
    same(*results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(cpu, gpu, dtype):
    rng = np.random.default_rng(3)
    cos, sin = np.zeros((MAX_SEQ, HD // 2), dtype), np.zeros((MAX_SEQ, HD // 2), dtype)
    cpu.rope_tables(cos, sin)
    x = rand(rng, dtype, 2, 3, H, HD)
    positions = np.array([[0, 1, 2], [0, 1, 0]])  # the second row packs two examples
    same(*run_both(cpu.rope_forward, gpu.rope_forward, x, cos, sin, positions)[:2])
    same(*run_both(cpu.rope_backward, gpu.rope_backward, x, cos, sin, positions)[:2])
    same(*run_both(cpu.rope_decode, gpu.rope_decode, x[:, :1].copy(), cos, sin, scalars=(5,))[:2])


@pytest.mark.parametrize("dtype", DTYPES)
# global, shorter than T, longer than T; packed: rows of two examples (positions restart at 2)
@pytest.mark.parametrize(("window", "packed"), [(0, False), (2, False), (5, False), (0, True), (3, True)])
@pytest.mark.parametrize("prefix", ATTENTION_SCALES)  # 1/sqrt(head_dim), another scale
def test_attention(cpu, gpu, dtype, window, packed, prefix):
    def kernels(name):
        return [getattr(m, f"{prefix}_{name}") for m in (cpu, gpu)]

    def both(name, window):
        # the kernels take (arrays..., window, positions): positions travel as the last array
        return [lambda *arrays, f=f: f(*arrays[:-1], window, arrays[-1]) for f in kernels(name)]

    rng = np.random.default_rng(4)
    b, t = 1, 4
    positions = np.array([[0, 1, 0, 1]] if packed else [[0, 1, 2, 3]])
    q = rand(rng, dtype, b, t, H, HD)
    k, v = rand(rng, dtype, b, t, KV, HD), rand(rng, dtype, b, t, KV, HD)
    dout = rand(rng, dtype, b, t, H * HD)
    att, out = np.zeros((b, H, t, t), dtype), np.zeros((b, t, H * HD), dtype)
    host, dev, _ = run_both(*both("forward", window), q, k, v, att, out, positions)
    same(host, dev)
    att = host[3]
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    backward = run_both(*both("backward", window), q, k, v, att, dout, *grads, positions)
    same(*backward[:2])
    if window >= t:  # a window covering the sequence is global attention, bit for bit
        _, forward_global, _ = run_both(*both("forward", 0), q, k, v, att, out, positions)
        _, backward_global, _ = run_both(*both("backward", 0), q, k, v, att, dout, *grads, positions)
        for ours, glob in zip(dev + backward[1], forward_global + backward_global):
            np.testing.assert_array_equal(ours, glob)
    if packed:
        return
    # decode over a cache whose slots hold the attended positions out of order (a ring buffer)
    first = max(t - window, 0) if window > 0 else 0
    order = np.roll(np.arange(first, t), 1)
    cache_k, cache_v = np.zeros((b, 6, KV, HD), dtype), np.zeros((b, 6, KV, HD), dtype)
    cache_k[:, : len(order)], cache_v[:, : len(order)] = k[:, order], v[:, order]
    q_last, n_valid = np.ascontiguousarray(q[:, -1:]), len(order)
    decode = [lambda q, kc, vc, out, f=f: f(q, kc, vc, n_valid, out) for f in kernels("decode")]
    same(*run_both(*decode, q_last, cache_k, cache_v, np.zeros((b, 1, H * HD), dtype))[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu", "relu"])
def test_activation(cpu, gpu, dtype, kind):
    rng = np.random.default_rng(5)
    x, dy = rand(rng, dtype, 2, 3, 7) * 3, rand(rng, dtype, 2, 3, 7)
    fwd = [getattr(m, f"{kind}_forward") for m in (cpu, gpu)]
    bwd = [getattr(m, f"{kind}_backward") for m in (cpu, gpu)]
    same(*run_both(*fwd, x, np.zeros_like(x))[:2])
    same(*run_both(*bwd, x, dy, np.zeros_like(x))[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", ["mlp", "geglu"])  # SwiGLU, GeGLU
def test_gated_mlp(cpu, gpu, dtype, prefix):
    rng = np.random.default_rng(6)
    g, u = rand(rng, dtype, 3, HIDDEN) * 3, rand(rng, dtype, 3, HIDDEN)
    dh = rand(rng, dtype, 3, HIDDEN)
    gate_up = np.concatenate([g, u], axis=1)
    fwd = [getattr(m, f"{prefix}_forward") for m in (cpu, gpu)]
    bwd = [getattr(m, f"{prefix}_backward") for m in (cpu, gpu)]
    same(*run_both(*fwd, gate_up, np.zeros_like(g))[:2])
    same(*run_both(*bwd, gate_up, dh, np.zeros_like(gate_up))[:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual(cpu, gpu, dtype):
    rng = np.random.default_rng(6)
    x, r = rand(rng, dtype, 3, HIDDEN), rand(rng, dtype, 3, HIDDEN)
    same(*run_both(cpu.residual_add, gpu.residual_add, x, r, np.zeros_like(x))[:2])
    same(*run_both(cpu.add_into, gpu.add_into, r, x)[:2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_cross_entropy(cpu, gpu, dtype, in_place):
    rng = np.random.default_rng(7)
    logits = rand(rng, dtype, 4, C) * 3
    targets = np.array([3, -100, 0, C - 1], np.int64)

    def run(module, logits, targets, dlogits):
        return module.ce_forward_backward(logits, targets, logits if in_place else dlogits)

    host, dev, (loss_cpu, loss_gpu) = run_both(
        lambda *a: run(cpu, *a), lambda *a: run(gpu, *a), logits, targets, np.zeros_like(logits)
    )
    same(host, dev)
    np.testing.assert_allclose(loss_gpu, loss_cpu, **TOL[dtype])
    _, _, (eval_cpu, eval_gpu) = run_both(cpu.ce_forward, gpu.ce_forward, logits, targets)
    np.testing.assert_allclose(eval_gpu, eval_cpu, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_cross_entropy_and_target_log_probs(cpu, gpu, dtype):
    """A preference loss's kernels: row weights in place of the mean's, and each target's
    log-probability (float64 whatever the logits' dtype)."""
    rng = np.random.default_rng(9)
    logits = rand(rng, dtype, 4, C) * 3
    targets = np.array([3, -100, 0, C - 1], np.int64)
    weights = rng.standard_normal(4)
    host, dev, _ = run_both(lambda *a: cpu.ce_forward_backward(*a[:3], token_weights=a[3]),
                            lambda *a: gpu.ce_forward_backward(*a[:3], token_weights=a[3]),
                            logits, targets, np.zeros_like(logits), weights)
    same(host, dev)
    host, dev, _ = run_both(cpu.target_log_probs, gpu.target_log_probs, logits, targets, np.full(4, np.nan))
    same(host, dev)
    assert host[2][1] == 0.0 and np.isfinite(host[2]).all()

@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw(cpu, gpu, dtype):
    rng = np.random.default_rng(8)
    params, grads = rand(rng, dtype, 300), rand(rng, dtype, 300)
    state = [params, grads, np.zeros(300, dtype), np.zeros(300, dtype)]
    host, dev = [a.copy() for a in state], [cuda.to_device(a) for a in state]
    for step in range(1, 4):
        cpu.adamw_step(*host, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        gpu.adamw_step(*dev, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
    same(host, [d.copy_to_host() for d in dev])
    np.testing.assert_allclose(gpu.adamw_grad_norm(dev[1]), cpu.adamw_grad_norm(host[1]), **TOL[dtype])
    same(*run_both(cpu.adamw_scale, gpu.adamw_scale, grads, scalars=(0.5,))[:2])
