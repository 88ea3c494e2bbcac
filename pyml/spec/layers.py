"""Pydantic models of the layer kinds a spec may use.

Every model forbids unknown keys, so a misspelt field is an error rather than a silently ignored
default. Feature dims are positive ints; batch and sequence dims are symbolic (B, T) and never
appear in a spec.

Two families of layers: the sequential kinds (linear, rmsnorm, the activations and residual) that
an MLP is a list of, and the block kinds (rmsnorm, attention, mlp and residual) that a decoder
block is a list of. A residual is a combinator in both: `x + body(x)`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    model_validator,
)

# Names become Python identifiers, package and Lean names in generated code: ASCII only.
Identifier = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Strict(BaseModel):
    """Base of every spec model: unknown keys are rejected, values are not coerced across types,
    and every number is finite (TOML can spell `inf` and `nan`).

    `name`, where a layer has one, is how errors and generated code refer to it; a layer without a
    name is called by its place in the spec (`layers[2]`, `block.mlp`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class Linear(Strict):
    kind: Literal["linear"] = "linear"
    name: Identifier | None = None
    in_features: PositiveInt
    out_features: PositiveInt
    bias: bool = True


class Embedding(Strict):
    """Token embedding; `scale` multiplies every row it gathers (Gemma scales by sqrt(dim))."""

    vocab_size: PositiveInt
    dim: PositiveInt
    scale: PositiveFloat = 1.0


class RMSNorm(Strict):
    """y = x / sqrt(mean(x²) + eps) * gain, the gain `w` or, with `unit_offset`, `1 + w` (Gemma)."""

    kind: Literal["rmsnorm"] = "rmsnorm"
    name: Identifier | None = None
    dim: PositiveInt
    eps: PositiveFloat = 1e-5
    unit_offset: bool = False


class LayerNorm(Strict):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b over each row's features, as
    torch.nn.LayerNorm (the variance is the biased one); `bias = false` leaves b out."""

    kind: Literal["layernorm"] = "layernorm"
    name: Identifier | None = None
    dim: PositiveInt
    eps: PositiveFloat = 1e-5
    bias: bool = True


class ReLU(Strict):
    kind: Literal["relu"] = "relu"
    name: Identifier | None = None


class GELU(Strict):
    kind: Literal["gelu"] = "gelu"
    name: Identifier | None = None


class SiLU(Strict):
    kind: Literal["silu"] = "silu"
    name: Identifier | None = None


class LinearScaling(Strict):
    """Positions divided by `factor` (transformers' rope_type "linear")."""

    type: Literal["linear"] = "linear"
    factor: PositiveFloat


class Llama3Scaling(Strict):
    """Llama 3.1's frequency scaling (transformers' rope_type "llama3"): frequencies whose
    wavelength exceeds original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those under original_max_position_embeddings / high_freq_factor are kept, and those
    between are interpolated smoothly between the two."""

    type: Literal["llama3"] = "llama3"
    factor: PositiveFloat
    low_freq_factor: PositiveFloat
    high_freq_factor: PositiveFloat
    original_max_position_embeddings: PositiveInt

    @model_validator(mode="after")
    def band_not_empty(self) -> Llama3Scaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope scaling: high_freq_factor {self.high_freq_factor} must exceed "
                f"low_freq_factor {self.low_freq_factor}"
            )
        return self


class LongRoPEScaling(Strict):
    """Phi-3's LongRoPE (transformers' rope_type "longrope"): frequency i divided by a factor of
    its own, `long_factor[i]` for a model built for more positions than
    original_max_position_embeddings (max_seq_len beyond it), `short_factor[i]` otherwise, and
    cos and sin multiplied by `attention_factor`. The factors are chosen once for the model, as
    llama.cpp chooses them by the context it is created with; transformers chooses per call, by
    the length of the sequence it runs, which is the same for every sequence when max_seq_len is
    at most original_max_position_embeddings, and for every sequence longer than it otherwise."""

    type: Literal["longrope"] = "longrope"
    short_factor: list[PositiveFloat] = Field(min_length=1)
    long_factor: list[PositiveFloat] = Field(min_length=1)
    original_max_position_embeddings: PositiveInt
    attention_factor: PositiveFloat


class RoPE(Strict):
    """Rotary position embedding on query and key heads (the half-split form Llama uses), its
    frequencies theta ** (-2i / dims), scaled as `scaling` says. `dims` rotates only the first
    features of each head and passes the others through (Phi's partial rotary; default: all)."""

    theta: PositiveFloat = 10000.0
    dims: PositiveInt | None = None
    scaling: Annotated[LinearScaling | Llama3Scaling | LongRoPEScaling,
                       Field(discriminator="type")] | None = None


class HeadNorm(Strict):
    """QK-norm: an RMSNorm over each query and key head's features, one gain per projection."""

    eps: PositiveFloat = 1e-6
    unit_offset: bool = False


class AttentionType(Strict):
    """What one layer's attention looks at: the whole causal past (no `window`), or the last
    `window` positions; `rope_theta` replaces the attention's RoPE base on such layers."""

    window: PositiveInt | None = None
    rope_theta: PositiveFloat | None = None


class Attention(Strict):
    """Causal grouped-query self-attention: fused q, k, v projections, optional QK-norm, RoPE, the
    scaled softmax, and the output projection. `pattern` gives the attention type of layer `l` as
    `pattern[l % len(pattern)]` (Gemma 3: five sliding-window layers, then a global one)."""

    kind: Literal["attention"] = "attention"
    name: Identifier | None = None
    dim: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt
    head_dim: PositiveInt
    rope: RoPE | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    scale: PositiveFloat | None = None  # of the scores; None: 1 / sqrt(head_dim)
    qk_norm: HeadNorm | None = None
    pattern: list[AttentionType] | None = Field(default=None, min_length=1)
    # q, k and v stored as one tensor, qkv_proj (rows q, then k, then v), as Phi-3's checkpoints
    # hold them; its LoRA target is then "qkv"
    fused_qkv: bool = False

    @model_validator(mode="after")
    def heads_fit(self) -> Attention:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"attention: n_kv_heads {self.n_kv_heads} must divide "
                f"n_heads {self.n_heads} (each key/value head serves a whole group of query heads)"
            )
        if self.rope is not None and self.rope.dims is None and self.head_dim % 2 != 0:
            raise ValueError(
                f"attention: RoPE rotates pairs of features, so head_dim must be "
                f"even, got {self.head_dim}"
            )
        if self.rope is not None and self.rope.dims is not None and (
                self.rope.dims % 2 != 0 or self.rope.dims > self.head_dim):
            raise ValueError(
                f"attention: rope.dims must be an even number of features of a head of "
                f"{self.head_dim}, got {self.rope.dims}"
            )
        scaling = self.rope.scaling if self.rope is not None else None
        if isinstance(scaling, LongRoPEScaling) and not (
                len(scaling.short_factor) == len(scaling.long_factor) == self.rotary_dims // 2):
            raise ValueError(
                f"attention: rope scaling's short_factor and long_factor must each have one factor "
                f"per rotated frequency ({self.rotary_dims // 2}), got {len(scaling.short_factor)} "
                f"and {len(scaling.long_factor)}"
            )
        if self.rope is None and any(kind.rope_theta is not None for kind in self.pattern or ()):
            raise ValueError("attention: a pattern entry sets rope_theta but the attention has no rope")
        if self.rope is not None and self.rope.scaling is not None and any(
                kind.rope_theta is not None for kind in self.pattern or ()):
            # which layers a scaling applies to, when their bases differ, is a model's choice
            # (Gemma 3 scales only its global layers); no spec here needs it yet
            raise ValueError("attention: rope scaling with a pattern entry's own rope_theta is not supported")
        return self

    @property
    def rotary_dims(self) -> int:
        """The features of each head RoPE rotates (the first ones)."""
        return self.rope.dims if self.rope and self.rope.dims else self.head_dim

    @property
    def score_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    def type_of_layer(self, layer: int) -> AttentionType:
        """Layer `layer`'s attention type, with its RoPE base filled in."""
        kind = self.pattern[layer % len(self.pattern)] if self.pattern else AttentionType()
        theta = kind.rope_theta or (self.rope.theta if self.rope else None)
        return AttentionType(window=kind.window, rope_theta=theta)


class MLP(Strict):
    """Gated MLP: down(act(gate(x)) * up(x)), act = silu (SwiGLU) or tanh-approximated GELU (GeGLU)."""

    kind: Literal["mlp"] = "mlp"
    name: Identifier | None = None
    dim: PositiveInt
    hidden: PositiveInt
    activation: Literal["swiglu", "geglu"] = "swiglu"
    bias: bool = False
    # gate and up stored as one tensor, gate_up_proj (rows gate, then up), as Phi-3's checkpoints
    # hold them; its LoRA target is then "gate_up"
    fused_gate_up: bool = False


class Residual(Strict):
    """x + body(x); the body must map a shape to itself."""

    kind: Literal["residual"] = "residual"
    name: Identifier | None = None
    body: list[SequentialLayer] = Field(min_length=1)


class BlockResidual(Strict):
    """x + body(x) inside a decoder block; the body is a list of block layers."""

    kind: Literal["residual"] = "residual"
    name: Identifier | None = None
    body: list[BlockLayer] = Field(min_length=1)


class DecoderBlock(Strict):
    """The repeated block, `count` times with separate weights: a composition of block layers
    (`layers`), or the pre-norm Llama shorthand `attn_norm`, `attention`, `mlp_norm`, `mlp`, which
    is x + attention(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    count: PositiveInt
    layers: list[BlockLayer] | None = Field(default=None, min_length=1)
    attn_norm: RMSNorm | None = None
    attention: Attention | None = None
    mlp_norm: RMSNorm | None = None
    mlp: MLP | None = None

    @model_validator(mode="after")
    def one_form(self) -> DecoderBlock:
        shorthand = {"attn_norm": self.attn_norm, "attention": self.attention,
                     "mlp_norm": self.mlp_norm, "mlp": self.mlp}
        given = [key for key, value in shorthand.items() if value is not None]
        if self.layers is not None and given:
            raise ValueError(f"give either layers or the shorthand tables, not both "
                             f"(found layers and {', '.join(given)})")
        if self.layers is None and len(given) != len(shorthand):
            missing = [key for key in shorthand if key not in given]
            raise ValueError(f"missing {', '.join(missing)} (or give the block as layers)")
        return self

    def composition(self) -> list[tuple[str, object]]:
        """(label, layer) of the block's top-level layers. The shorthand expands into the Llama
        composition, its layers named as Hugging Face names them and labelled as the user wrote
        them (`block.attn_norm`); a residual's body layers are labelled in `body_labels`."""
        if self.layers is not None:
            return [(f"block.layers[{i}]", layer) for i, layer in enumerate(self.layers)]
        named = lambda layer, name: layer.model_copy(update={"name": layer.name or name})  # noqa: E731
        return [
            ("block.attn_residual", BlockResidual(body=[named(self.attn_norm, "input_layernorm"),
                                                        named(self.attention, "self_attn")])),
            ("block.mlp_residual", BlockResidual(body=[named(self.mlp_norm, "post_attention_layernorm"),
                                                       named(self.mlp, "mlp")])),
        ]

    def body_labels(self, label: str, residual: BlockResidual) -> list[str]:
        if self.layers is None:
            return SHORTHAND_LABELS[label]
        return [f"{label}.body[{i}]" for i in range(len(residual.body))]


SHORTHAND_LABELS = {"block.attn_residual": ["block.attn_norm", "block.attention"],
                    "block.mlp_residual": ["block.mlp_norm", "block.mlp"]}


# "qkv" and "gate_up": the projections stored as one tensor (`fused_qkv`, `fused_gate_up`)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")


class LoRA(Strict):
    """Low-rank adapters on the chosen projections of every block, as the `peft` library's LoRA:
    a projection W becomes W + (alpha / rank) B A, with A (rank, in) and B (out, rank). The base
    model's parameters are frozen; the adapters are what trains. The defaults are PEFT's."""

    rank: PositiveInt
    alpha: PositiveFloat = 8.0
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up"]] = Field(
        default=["q", "v"], min_length=1)

    @model_validator(mode="after")
    def targets_unique(self) -> LoRA:
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets repeats a projection: {self.targets}")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LMHead(Strict):
    """Projection from the model dim to vocabulary logits; `tied` reuses the embedding matrix."""

    dim: PositiveInt
    vocab_size: PositiveInt
    tied: bool


class SoftmaxCrossEntropy(Strict):
    """Mean over positions of -log softmax(logits)[target]."""

    kind: Literal["softmax_cross_entropy"] = "softmax_cross_entropy"


SequentialLayer = Annotated[
    Union[Linear, RMSNorm, LayerNorm, ReLU, GELU, SiLU, Residual],
    Field(discriminator="kind"),
]
BlockLayer = Annotated[
    Union[RMSNorm, LayerNorm, Attention, MLP, BlockResidual],
    Field(discriminator="kind"),
]
Residual.model_rebuild()
BlockResidual.model_rebuild()
DecoderBlock.model_rebuild()

SEQUENTIAL_LAYER_KINDS = ("linear", "rmsnorm", "layernorm", "relu", "gelu", "silu", "residual")
BLOCK_LAYER_KINDS = ("rmsnorm", "layernorm", "attention", "mlp", "residual")
