"""The two model forms: a sequential stack (MLPs) and a Llama-family decoder.

Each form flattens itself into shape-check nodes (`nodes`) and checks them (`shape_mismatches`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, PositiveInt, model_validator

from pyml.spec.layers import (
    DecoderBlock,
    Embedding,
    Identifier,
    Linear,
    LMHead,
    Residual,
    RMSNorm,
    SequentialLayer,
    SoftmaxCrossEntropy,
    Strict,
)
from pyml.spec.shapes import IDS, Mismatch, Node, Shape, check_chain


def layer_name(layer, place: str) -> str:
    return layer.name if getattr(layer, "name", None) else place


def sequential_node(layer, place: str) -> Node:
    name = layer_name(layer, place)
    if isinstance(layer, Linear):
        return Node(name, layer.in_features, layer.out_features)
    if isinstance(layer, RMSNorm):
        return Node(name, layer.dim, layer.dim)
    if isinstance(layer, Residual):
        body = tuple(sequential_node(inner, f"{name}.body[{i}]") for i, inner in enumerate(layer.body))
        return Node(name, None, None, body)
    return Node(name, None, None)  # element-wise activation: any features, same out


class SequentialModel(Strict):
    """A stack of layers applied in order to a (B, input_dim) batch, ending in a loss over
    output_dim classes."""

    form: Literal["sequential"]
    name: Identifier
    input_dim: PositiveInt
    output_dim: PositiveInt
    layers: list[SequentialLayer] = Field(min_length=1)
    loss: SoftmaxCrossEntropy = SoftmaxCrossEntropy()

    batch: ClassVar[tuple[str, ...]] = ("B",)

    @model_validator(mode="after")
    def names_unique(self) -> SequentialModel:
        seen: set[str] = set()

        def visit(layers) -> None:
            for layer in layers:
                if layer.name is not None:
                    if layer.name in seen:
                        raise ValueError(f"two layers are named '{layer.name}'; names must be unique")
                    seen.add(layer.name)
                if isinstance(layer, Residual):
                    visit(layer.body)

        visit(self.layers)
        return self

    def nodes(self) -> list[Node]:
        return [sequential_node(layer, f"layers[{i}]") for i, layer in enumerate(self.layers)]

    def shape_mismatches(self) -> list[Mismatch]:
        chain = [*self.nodes(), Node("output", self.output_dim, None)]
        return check_chain(self.batch, Shape(self.batch, self.input_dim), "input", chain)[0]


class DecoderModel(Strict):
    """A Llama-family decoder: embedding, `block.count` pre-norm blocks, final norm, LM head."""

    form: Literal["decoder"]
    name: Identifier
    max_seq_len: PositiveInt
    embedding: Embedding
    block: DecoderBlock
    final_norm: RMSNorm
    lm_head: LMHead
    loss: SoftmaxCrossEntropy = SoftmaxCrossEntropy()

    batch: ClassVar[tuple[str, ...]] = ("B", "T")

    def nodes(self) -> list[Node]:
        block = self.block
        attn_dim, mlp_dim = block.attention.dim, block.mlp.dim
        return [
            Node("embedding", IDS, self.embedding.dim),
            Node("block.attn_residual", None, None, (
                Node("block.attn_norm", block.attn_norm.dim, block.attn_norm.dim),
                Node("block.attention", attn_dim, attn_dim),
            )),
            Node("block.mlp_residual", None, None, (
                Node("block.mlp_norm", block.mlp_norm.dim, block.mlp_norm.dim),
                Node("block.mlp", mlp_dim, mlp_dim),
            )),
            Node("final_norm", self.final_norm.dim, self.final_norm.dim),
            Node("lm_head", self.lm_head.dim, self.lm_head.vocab_size),
            Node("loss", self.embedding.vocab_size, None),
        ]

    def shape_mismatches(self) -> list[Mismatch]:
        mismatches = check_chain(self.batch, Shape(self.batch, None), "input_ids", self.nodes())[0]
        head, embedding = self.lm_head, self.embedding
        if head.tied and (head.vocab_size, head.dim) != (embedding.vocab_size, embedding.dim):
            # the tied head multiplies by the embedding matrix itself, so both shapes must agree
            mismatches.append(Mismatch(
                "embedding", "lm_head (tied)",
                Shape((str(embedding.vocab_size),), embedding.dim),
                Shape((str(head.vocab_size),), head.dim),
            ))
        return mismatches


ModelSpec = Annotated[Union[SequentialModel, DecoderModel], Field(discriminator="form")]
