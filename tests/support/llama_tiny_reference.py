"""llama_tiny's logits at every position in float64 numpy, read off its spec: the reference the
fused decode steps (CPU and CUDA) are checked against."""

from pathlib import Path

import numpy as np

from pyml.spec import load_spec
from tests.support.project_packages import project_package

tiny = project_package("llama_tiny").model

ROOT = Path(__file__).resolve().parents[2]


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
