"""An independent PyTorch model built from a spec: the reference the generator is fuzzed against.

Written from the layer kinds' definitions (the spec's docstrings and the Hugging Face models they
follow), not from the generator: plain torch ops, autograd for every gradient, float64. Parameters
carry the generated packages' tensor names, so one dict of tensors loads both.
"""

from __future__ import annotations

import math

import torch

from pyml.spec.layers import (
    GELU,
    MLP,
    Attention,
    BlockResidual,
    LayerNorm,
    Linear,
    ReLU,
    Residual,
    RMSNorm,
    SiLU,
)
from pyml.spec.models import DecoderModel, SequentialModel


def rms_norm(x, weight, eps, unit_offset):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + weight) if unit_offset else weight)


def layer_norm(reference, x, layer: LayerNorm, name: str):
    bias = reference.w(f"{name}.bias") if layer.bias else None
    return torch.nn.functional.layer_norm(x, (layer.dim,), reference.w(f"{name}.weight"), bias, layer.eps)


def scaled_in_float64(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """transformers' linear and llama3 RoPE scaling (modeling_rope_utils), on float64 `inv_freq`;
    `scaling` is a spec's RoPE scaling as a dict."""
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context_len / high) * ~(wavelen > old_context_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate(x, theta, positions, scaling=None, dims=None, max_seq_len=None):
    """Llama's rotate_half RoPE on (B, heads, T, head_dim), positions (B, T), the frequencies
    scaled as `scaling` (a spec's RoPE scaling, as a dict) says; with `dims`, on the first `dims`
    features only, the others passed through (Phi's partial rotary). LongRoPE takes its long
    factors for a model of `max_seq_len` positions beyond the original context (test_rope_scaling
    checks that rule against transformers)."""
    if dims is not None and dims < x.shape[-1]:
        return torch.cat([rotate(x[..., :dims], theta, positions, scaling, None, max_seq_len),
                          x[..., dims:]], -1)
    half = x.shape[-1] // 2
    powers = theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    attention_factor = 1.0
    if scaling is not None and scaling["type"] == "longrope":
        long = max_seq_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv_freq, attention_factor = 1.0 / (factors * powers), scaling["attention_factor"]
    else:
        inv_freq = 1.0 / powers
        if scaling is not None:
            inv_freq = scaled_in_float64(inv_freq, scaling)
    angles = positions[:, None, :, None].to(torch.float64) * inv_freq  # (B, 1, T, half)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., :half], x[..., half:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin) * attention_factor


def gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


class Reference(torch.nn.Module):
    """`spec`'s model; `tensors` ({name: array}) gives every parameter its value."""

    def __init__(self, spec, tensors):
        super().__init__()
        self.spec = spec
        self.weights = torch.nn.ParameterDict({
            name.replace(".", "|"): torch.nn.Parameter(torch.tensor(value, dtype=torch.float64))
            for name, value in tensors.items()})

    def w(self, name):
        return self.weights[name.replace(".", "|")]

    def has(self, name):
        return name.replace(".", "|") in self.weights

    # -- sequential -------------------------------------------------------------------------------

    def sequential(self, layers, x, place):
        for index, layer in enumerate(layers):
            name = layer.name or f"{place}{index}"
            if isinstance(layer, Linear):
                x = x @ self.w(f"{name}.weight").T
                if layer.bias:
                    x = x + self.w(f"{name}.bias")
            elif isinstance(layer, RMSNorm):
                x = rms_norm(x, self.w(f"{name}.weight"), layer.eps, layer.unit_offset)
            elif isinstance(layer, LayerNorm):
                x = layer_norm(self, x, layer, name)
            elif isinstance(layer, ReLU):
                x = torch.relu(x)
            elif isinstance(layer, GELU):
                x = torch.nn.functional.gelu(x)
            elif isinstance(layer, SiLU):
                x = torch.nn.functional.silu(x)
            elif isinstance(layer, Residual):
                x = x + self.sequential(layer.body, x, f"{name}_body")
        return x

    # -- decoder ----------------------------------------------------------------------------------

    def projection(self, name: str, x, bias: bool, target: str):
        """x W^T (+ b), and with a LoRA adapter on `target`, + (alpha / rank) (x A^T) B^T."""
        y = x @ self.w(f"{name}.weight").T
        if bias:
            y = y + self.w(f"{name}.bias")
        lora = getattr(self.spec, "lora", None)
        if lora is not None and target in lora.targets:
            y = y + lora.scale * ((x @ self.w(f"{name}.lora_A.weight").T)
                                  @ self.w(f"{name}.lora_B.weight").T)
        return y

    def attention(self, a: Attention, prefix: str, x, layer: int, positions):
        B, T, _ = x.shape
        H, KV, HD = a.n_heads, a.n_kv_heads, a.head_dim

        def project(part, heads):
            y = self.projection(f"{prefix}.{part}_proj", x, a.qkv_bias, part)
            return y.view(B, T, heads, HD).transpose(1, 2)  # (B, heads, T, HD)

        q, k, v = project("q", H), project("k", KV), project("v", KV)
        if a.qk_norm is not None:
            q = rms_norm(q, self.w(f"{prefix}.q_norm.weight"), a.qk_norm.eps, a.qk_norm.unit_offset)
            k = rms_norm(k, self.w(f"{prefix}.k_norm.weight"), a.qk_norm.eps, a.qk_norm.unit_offset)
        kind = a.type_of_layer(layer)
        if a.rope is not None:
            scaling = a.rope.scaling.model_dump() if a.rope.scaling else None
            q, k = (rotate(q, kind.rope_theta, positions, scaling, a.rope.dims, self.spec.max_seq_len),
                    rotate(k, kind.rope_theta, positions, scaling, a.rope.dims, self.spec.max_seq_len))
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = (q @ k.transpose(-1, -2)) * a.score_scale
        t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = j <= t
        if kind.window:
            allowed &= j > t - kind.window
        # a row packing several examples: t attends to j only from its example's first token on
        allowed = allowed[None] & (j[None] >= (torch.arange(T) - positions)[:, :, None])
        scores = scores.masked_fill(~allowed[:, None], -math.inf)
        y = torch.softmax(scores, -1) @ v  # (B, H, T, HD)
        return self.projection(f"{prefix}.o_proj", y.transpose(1, 2).reshape(B, T, H * HD),
                               a.out_bias, "o")

    def mlp(self, m: MLP, prefix: str, x):
        def project(part, y):
            return self.projection(f"{prefix}.{part}_proj", y, m.bias, part)

        act = torch.nn.functional.silu if m.activation == "swiglu" else gelu_tanh
        return project("down", act(project("gate", x)) * project("up", x))

    def block(self, items, x, layer: int, positions):
        for item in items:
            prefix = f"model.layers.{layer}.{item.name}"
            if isinstance(item.layer, BlockResidual):
                x = x + self.block(item.body, x, layer, positions)
            elif isinstance(item.layer, RMSNorm):
                x = rms_norm(x, self.w(f"{prefix}.weight"), item.layer.eps, item.layer.unit_offset)
            elif isinstance(item.layer, LayerNorm):
                x = layer_norm(self, x, item.layer, prefix)
            elif isinstance(item.layer, Attention):
                x = self.attention(item.layer, prefix, x, layer, positions)
            elif isinstance(item.layer, MLP):
                x = self.mlp(item.layer, prefix, x)
        return x

    def forward(self, inputs, positions=None):
        """Logits; a decoder's `positions` (B, T) are each token's position in its example
        (default: 0..T-1 in every row), the examples packed in a row attending within themselves."""
        spec = self.spec
        if isinstance(spec, SequentialModel):
            return self.sequential(spec.layers, inputs, "layer")
        assert isinstance(spec, DecoderModel)
        embed = self.w("model.embed_tokens.weight")
        x = embed[inputs] * spec.embedding.scale
        B, T = inputs.shape
        positions = torch.arange(T).expand(B, T) if positions is None else torch.as_tensor(positions)
        items = spec.block_items()
        for layer in range(spec.block.count):
            x = self.block(items, x, layer, positions)
        norm = spec.final_norm
        x = rms_norm(x, self.w("model.norm.weight"), norm.eps, norm.unit_offset)
        head = embed if spec.lm_head.tied else self.w("lm_head.weight")
        return x @ head.T


def loss_and_grads(reference: Reference, inputs, targets, positions=None):
    """(logits, loss, {tensor name: gradient}) of mean cross-entropy, float64; a decoder's
    `positions` as `Reference.forward` takes them."""
    reference.zero_grad()
    packed = {} if positions is None else {"positions": positions}
    logits = reference(torch.as_tensor(inputs), **packed)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(targets).reshape(-1))
    loss.backward()
    grads = {name.replace("|", "."): p.grad.numpy().copy() for name, p in reference.weights.items()}
    return logits.detach().numpy(), loss.item(), grads
