"""rope: the rotary position embedding of q and k heads, in place (Hugging Face Llama's
rotate_half form). With x1 = x[..., :hd/2], x2 = x[..., hd/2:]:
    out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin
Lean law rotation_adjoint: a rotation of each (x1[i], x2[i]) pair, whose adjoint is its transpose.
"""

import numpy as np
from numba import njit, prange


def rope_tables(cos, sin, theta, scaling=None):
    # cos, sin are (max_seq_len, head_dim / 2); `scaling` is the spec's RoPE scaling as a dict
    # (its `type` and parameters) or None.
    # float64 tables are computed in float64: a float64 model is the reference-precision one.
    # float32 tables follow transformers' rotary embeddings, which compute in float32: inv_freq
    # and the angles equal torch's bit for bit (float64 pow rounded to float32 is correctly rounded,
    # as torch's float32 pow is); cos and sin are the correctly rounded float32 values, and torch's
    # SLEEF float32 cos/sin (1 ulp) differ from them by at most 1 ulp on about 5% of the entries.
    max_seq_len, head_dim = cos.shape[0], 2 * cos.shape[1]
    real = cos.dtype.type
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(real) / real(head_dim)
    if real is np.float64:
        powers = theta**exponents
    else:
        powers = (theta ** exponents.astype(np.float64)).astype(real)
    if scaling is not None and scaling["type"] == "longrope":
        inv_freq = real(1.0) / (longrope_factors(scaling, max_seq_len).astype(real) * powers)
    else:
        inv_freq = scaled_frequencies(real(1.0) / powers, scaling)
    positions = np.arange(max_seq_len, dtype=np.int64).astype(real)
    freqs = (positions[:, None] * inv_freq[None, :]).astype(np.float64)
    cos[:] = np.cos(freqs).astype(cos.dtype)
    sin[:] = np.sin(freqs).astype(sin.dtype)
    if scaling is not None and scaling["type"] == "longrope":
        # as transformers' Phi3RotaryEmbedding: the float32 cos and sin times attention_factor
        cos *= real(scaling["attention_factor"])
        sin *= real(scaling["attention_factor"])


def longrope_factors(scaling, max_seq_len):
    """LongRoPE's factor of each frequency for a model of `max_seq_len` positions: the long ones
    beyond original_max_position_embeddings, as llama.cpp chooses by its context size and
    transformers' _compute_longrope_parameters by the sequence's length."""
    long = max_seq_len > scaling["original_max_position_embeddings"]
    return np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)


def scaled_frequencies(inv_freq, scaling):
    """The inverse frequencies `inv_freq` scaled as `scaling` says (linear or llama3), in their
    own precision, as transformers' _compute_linear_scaling_rope_parameters and
    _compute_llama3_parameters scale them (llama.cpp's converter stores the same llama3 factors
    as its rope_freqs tensor)."""
    if scaling is None:
        return inv_freq
    real = inv_freq.dtype.type
    factor = real(scaling["factor"])
    if scaling["type"] == "linear":
        return inv_freq / factor
    low, high = real(scaling["low_freq_factor"]), real(scaling["high_freq_factor"])
    context = real(scaling["original_max_position_embeddings"])
    wavelen = real(2 * np.pi) / inv_freq
    # long wavelengths slowed by `factor`, short ones kept, those between interpolated
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (real(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return np.where(medium, smoothed, scaled).astype(real)


@njit(cache=True, parallel=True)
def rope_forward(x, cos, sin, positions):
    # x is (B, T, H, head_dim), rotated in place; token t of row b sits at positions[b, t] (B, T):
    # t for a row holding one sequence, restarting at 0 at each example packed in a row.
    n_batch, n_tokens, n_heads = x.shape[0], x.shape[1], x.shape[2]
    half = cos.shape[1]
    for bt in prange(n_batch * n_tokens):
        b = bt // n_tokens
        t = bt % n_tokens
        pos = positions[b, t]
        for h in range(n_heads):
            for i in range(half):
                x1 = x[b, t, h, i]
                x2 = x[b, t, h, i + half]
                x[b, t, h, i] = x1 * cos[pos, i] - x2 * sin[pos, i]
                x[b, t, h, i + half] = x2 * cos[pos, i] + x1 * sin[pos, i]


@njit(cache=True, parallel=True)
def rope_decode(x, cos, sin, position):
    # x is (B, 1, H, head_dim): one new token per sequence, at `position`, rotated in place.
    n_batch, n_heads = x.shape[0], x.shape[2]
    half = cos.shape[1]
    if position >= cos.shape[0]:
        raise ValueError("sequence longer than the rope tables' max_seq_len")
    for bh in prange(n_batch * n_heads):
        b = bh // n_heads
        h = bh % n_heads
        for i in range(half):
            x1 = x[b, 0, h, i]
            x2 = x[b, 0, h, i + half]
            x[b, 0, h, i] = x1 * cos[position, i] - x2 * sin[position, i]
            x[b, 0, h, i + half] = x2 * cos[position, i] + x1 * sin[position, i]


@njit(cache=True)
def rope_decode_rows(x, cos, sin, positions):
    # x is (B, 1, H, head_dim): one new token per sequence, sequence b's at positions[b] (B,), each
    # rotated by rope_decode alone, so a sequence's result does not depend on the others'.
    for b in range(x.shape[0]):
        rope_decode(x[b : b + 1], cos, sin, positions[b])


@njit(cache=True, parallel=True)
def rope_backward(dx, cos, sin, positions):
    # in the forward pass this was (token t of row b at pos = positions[b, t]):
    #   out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin
    # so now we have the transposed rotation (sin -> -sin), in place on dx (B, T, H, head_dim):
    #   dx1 = d1 * cos + d2 * sin,  dx2 = d2 * cos - d1 * sin
    n_batch, n_tokens, n_heads = dx.shape[0], dx.shape[1], dx.shape[2]
    half = cos.shape[1]
    for bt in prange(n_batch * n_tokens):
        b = bt // n_tokens
        t = bt % n_tokens
        pos = positions[b, t]
        for h in range(n_heads):
            for i in range(half):
                d1 = dx[b, t, h, i]
                d2 = dx[b, t, h, i + half]
                dx[b, t, h, i] = d1 * cos[pos, i] + d2 * sin[pos, i]
                dx[b, t, h, i + half] = d2 * cos[pos, i] - d1 * sin[pos, i]
