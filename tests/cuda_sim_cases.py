"""CUDA kernels under Numba's CUDA simulator, against the CPU kernels (float64, rtol 1e-12).

Not collected directly (the name does not start with test_): tests/test_cuda_sim.py runs
this file in a child pytest process with NUMBA_ENABLE_CUDASIM=1, because the variable only takes
effect if it is set before numba.cuda is first imported, and pytest imports every test module of a
session before running any.
"""

from __future__ import annotations

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from kernel_harness import DIMS, all_blocks, load  # noqa: E402
from numba import cuda  # noqa: E402

D, HIDDEN, V = DIMS["dim"], DIMS["hidden"], DIMS["vocab"]
H, KV, HD, C = DIMS["n_heads"], DIMS["n_kv_heads"], DIMS["head_dim"], DIMS["classes"]
MAX_SEQ = 32
TOL = dict(rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def cpu():
    return load("cpu", all_blocks("cpu"))


@pytest.fixture(scope="module")
def gpu():
    assert cuda.simulator_enabled if hasattr(cuda, "simulator_enabled") else True
    return load("cuda", all_blocks("cuda"))


def run_both(cpu_fn, gpu_fn, *arrays, scalars=()):
    """Call both kernels on copies of `arrays` (+ scalars); return (cpu arrays, gpu arrays, results)."""
    host = [a.copy() for a in arrays]
    dev = [cuda.to_device(a.copy()) for a in arrays]
    r_cpu = cpu_fn(*host, *scalars)
    r_gpu = gpu_fn(*dev, *scalars)
    return host, [d.copy_to_host() for d in dev], (r_cpu, r_gpu)


def same(host, dev):
    for a, b in zip(host, dev, strict=True):
        np.testing.assert_allclose(b, a, **TOL)


def rand(rng, *shape):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(cpu, gpu, bias):
    rng = np.random.default_rng(0)
    n = 5
    x, w, b, dy = rand(rng, n, D), rand(rng, HIDDEN, D), rand(rng, HIDDEN), rand(rng, n, HIDDEN)
    y, dx, dw, db = np.zeros((n, HIDDEN)), np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)
    name = "fc_bias" if bias else "fc"
    if bias:
        same(
            *run_both(getattr(cpu, f"{name}_forward"), getattr(gpu, f"{name}_forward"), x, w, b, y)[
                :2
            ]
        )
        same(*run_both(cpu.fc_bias_backward, gpu.fc_bias_backward, x, w, dy, dx, dw, db)[:2])
    else:
        same(*run_both(cpu.fc_forward, gpu.fc_forward, x, w, y)[:2])
        same(*run_both(cpu.fc_backward, gpu.fc_backward, x, w, dy, dx, dw)[:2])


def test_embedding(cpu, gpu):
    rng = np.random.default_rng(1)
    ids = np.array([3, 0, 3, 7, 3], np.int64)
    table, dout, dtable = rand(rng, V, D), rand(rng, 5, D), rand(rng, V, D)
    same(*run_both(cpu.tok_forward, gpu.tok_forward, ids, table, np.zeros((5, D)))[:2])
    same(*run_both(cpu.tok_backward, gpu.tok_backward, ids, dout, dtable)[:2])


def test_rmsnorm(cpu, gpu):
    rng = np.random.default_rng(2)
    x, w, dy = rand(rng, 3, D), rand(rng, D), rand(rng, 3, D)
    host, _, _ = run_both(cpu.norm_forward, gpu.norm_forward, x, w, np.zeros((3, D)), np.zeros(3))
    same(*run_both(cpu.norm_forward, gpu.norm_forward, x, w, np.zeros((3, D)), np.zeros(3))[:2])
    rstd = host[3]
    same(
        *run_both(
            cpu.norm_backward, gpu.norm_backward, x, w, rstd, dy, np.zeros((3, D)), np.zeros(D)
        )[:2]
    )
    stream, r = rand(rng, 3, D), rand(rng, 3, D)
    same(*run_both(cpu.norm_backward_add, gpu.norm_backward_add, x, w, rstd, dy, stream,
                   np.zeros(D))[:2])
    same(*run_both(cpu.norm_forward_residual, gpu.norm_forward_residual, x, r, np.zeros((3, D)),
                   w, np.zeros((3, D)), np.zeros(3))[:2])


def test_rope(cpu, gpu):
    rng = np.random.default_rng(3)
    tables = [np.zeros((MAX_SEQ, HD // 2)), np.zeros((MAX_SEQ, HD // 2))]
    host, dev, _ = run_both(cpu.rope_tables, gpu.rope_tables, *tables)
    for a, b in zip(host, dev, strict=True):
        np.testing.assert_array_equal(a, b)
    cos, sin = host
    x = rand(rng, 1, 3, H, HD)
    same(*run_both(cpu.rope_forward, gpu.rope_forward, x, cos, sin, scalars=(5,))[:2])
    same(*run_both(cpu.rope_backward, gpu.rope_backward, x, cos, sin)[:2])


def test_attention(cpu, gpu):
    rng = np.random.default_rng(4)
    b, t = 1, 3
    q, k, v = rand(rng, b, t, H, HD), rand(rng, b, t, KV, HD), rand(rng, b, t, KV, HD)
    dout = rand(rng, b, t, H * HD)
    att, out = np.zeros((b, H, t, t)), np.zeros((b, t, H * HD))
    host, dev, _ = run_both(cpu.attn_forward, gpu.attn_forward, q, k, v, att, out)
    same(host, dev)
    att = host[3]
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    same(*run_both(cpu.attn_backward, gpu.attn_backward, q, k, v, att, dout, *grads)[:2])
    cache_k, cache_v = np.zeros((b, 6, KV, HD)), np.zeros((b, 6, KV, HD))
    cache_k[:, :t], cache_v[:, :t] = k, v
    q_last = np.ascontiguousarray(q[:, -1:])
    decode_cpu = lambda q, kc, vc, out: cpu.attn_decode(q, kc, vc, t, out)  # noqa: E731
    decode_gpu = lambda q, kc, vc, out: gpu.attn_decode(q, kc, vc, t, out)  # noqa: E731
    same(*run_both(decode_cpu, decode_gpu, q_last, cache_k, cache_v, np.zeros((b, 1, H * HD)))[:2])


@pytest.mark.parametrize("kind", ["silu", "gelu", "relu"])
def test_activation(cpu, gpu, kind):
    rng = np.random.default_rng(5)
    x, dy = rand(rng, 2, 3, 7) * 3, rand(rng, 2, 3, 7)
    fwd = [getattr(m, f"{kind}_forward") for m in (cpu, gpu)]
    bwd = [getattr(m, f"{kind}_backward") for m in (cpu, gpu)]
    same(*run_both(*fwd, x, np.zeros_like(x))[:2])
    same(*run_both(*bwd, x, dy, np.zeros_like(x))[:2])


def test_swiglu_and_residual(cpu, gpu):
    rng = np.random.default_rng(6)
    g, u, dh = rand(rng, 3, HIDDEN) * 3, rand(rng, 3, HIDDEN), rand(rng, 3, HIDDEN)
    gate_up = np.concatenate([g, u], axis=1)
    same(*run_both(cpu.mlp_forward, gpu.mlp_forward, gate_up, np.zeros_like(g))[:2])
    same(*run_both(cpu.mlp_backward, gpu.mlp_backward, gate_up, dh, np.zeros_like(gate_up))[:2])
    same(*run_both(cpu.residual_add, gpu.residual_add, g, u, np.zeros_like(g))[:2])
    same(*run_both(cpu.add_into, gpu.add_into, u, g)[:2])


@pytest.mark.parametrize("in_place", [False, True])
def test_cross_entropy(cpu, gpu, in_place):
    rng = np.random.default_rng(7)
    logits = rand(rng, 4, C) * 3
    targets = np.array([3, -100, 0, C - 1], np.int64)

    def run(module, logits, targets, dlogits):
        return module.ce_forward_backward(logits, targets, logits if in_place else dlogits)

    host, dev, (loss_cpu, loss_gpu) = run_both(
        lambda *a: run(cpu, *a), lambda *a: run(gpu, *a), logits, targets, np.zeros_like(logits)
    )
    same(host, dev)
    np.testing.assert_allclose(loss_gpu, loss_cpu, **TOL)
    _, _, (eval_cpu, eval_gpu) = run_both(cpu.ce_forward, gpu.ce_forward, logits, targets)
    np.testing.assert_allclose(eval_gpu, eval_cpu, **TOL)


def test_adamw(cpu, gpu):
    rng = np.random.default_rng(8)
    params, grads = rand(rng, 300), rand(rng, 300)
    state = [params, grads, np.zeros(300), np.zeros(300)]
    host, dev = [a.copy() for a in state], [cuda.to_device(a) for a in state]
    for step in range(1, 4):
        cpu.adamw_step(*host, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        gpu.adamw_step(*dev, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
    same(host, [d.copy_to_host() for d in dev])
    np.testing.assert_allclose(gpu.adamw_grad_norm(dev[1]), cpu.adamw_grad_norm(host[1]), **TOL)
    same(*run_both(cpu.adamw_scale, gpu.adamw_scale, grads, scalars=(0.5,))[:2])
