"""Pydantic models of the layer kinds a spec may use.

Every model forbids unknown keys, so a misspelt field is an error rather than a silently ignored
default. Feature dims are positive ints; batch and sequence dims are symbolic (B, T) and never
appear in a spec.
"""

from __future__ import annotations

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
    """Base of every spec model: unknown keys are rejected, values are not coerced across types.

    `name`, where a layer has one, is how errors and generated code refer to it; a layer without a
    name is called by its place in the spec (`layers[2]`, `block.mlp`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Linear(Strict):
    kind: Literal["linear"] = "linear"
    name: Identifier | None = None
    in_features: PositiveInt
    out_features: PositiveInt
    bias: bool = True


class Embedding(Strict):
    vocab_size: PositiveInt
    dim: PositiveInt


class RMSNorm(Strict):
    kind: Literal["rmsnorm"] = "rmsnorm"
    name: Identifier | None = None
    dim: PositiveInt
    eps: PositiveFloat = 1e-5


class ReLU(Strict):
    kind: Literal["relu"] = "relu"
    name: Identifier | None = None


class GELU(Strict):
    kind: Literal["gelu"] = "gelu"
    name: Identifier | None = None


class SiLU(Strict):
    kind: Literal["silu"] = "silu"
    name: Identifier | None = None


class RoPE(Strict):
    """Rotary position embedding on query and key heads (the half-split form Llama uses)."""

    theta: PositiveFloat = 10000.0


class Attention(Strict):
    """Causal grouped-query self-attention: q, k, v and output projections, no biases."""

    dim: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt
    head_dim: PositiveInt
    rope: RoPE | None = None

    @model_validator(mode="after")
    def heads_fit(self) -> Attention:
        if self.dim != self.n_heads * self.head_dim:
            raise ValueError(
                f"attention: dim {self.dim} must equal n_heads*head_dim = "
                f"{self.n_heads}*{self.head_dim} = {self.n_heads * self.head_dim}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"attention: n_kv_heads {self.n_kv_heads} must divide "
                f"n_heads {self.n_heads} (each key/value head serves a whole group of query heads)"
            )
        if self.rope is not None and self.head_dim % 2 != 0:
            raise ValueError(
                f"attention: RoPE rotates pairs of features, so head_dim must be "
                f"even, got {self.head_dim}"
            )
        return self


class SwiGLU(Strict):
    """Gated MLP: down(silu(gate(x)) * up(x)), no biases."""

    dim: PositiveInt
    hidden: PositiveInt


class Residual(Strict):
    """x + body(x); the body must map a shape to itself."""

    kind: Literal["residual"] = "residual"
    name: Identifier | None = None
    body: list[SequentialLayer] = Field(min_length=1)


class DecoderBlock(Strict):
    """One pre-norm Llama block, repeated `count` times with separate weights:
    x + attention(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    count: PositiveInt
    attn_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU


class LMHead(Strict):
    """Projection from the model dim to vocabulary logits; `tied` reuses the embedding matrix."""

    dim: PositiveInt
    vocab_size: PositiveInt
    tied: bool


class SoftmaxCrossEntropy(Strict):
    """Mean over positions of -log softmax(logits)[target]."""

    kind: Literal["softmax_cross_entropy"] = "softmax_cross_entropy"


SequentialLayer = Annotated[
    Union[Linear, RMSNorm, ReLU, GELU, SiLU, Residual],
    Field(discriminator="kind"),
]
Residual.model_rebuild()

SEQUENTIAL_LAYER_KINDS = ("linear", "rmsnorm", "relu", "gelu", "silu", "residual")
