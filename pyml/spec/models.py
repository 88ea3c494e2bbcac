"""The two model forms: a sequential stack (MLPs) and a decoder (a repeated block of layers).

Each form flattens itself into shape-check nodes (`nodes`) and checks them (`shape_mismatches`).
A decoder's block is resolved into `BlockItem`s: every layer with the label errors use (where the
user wrote it) and the name generated code and tensor files use.
"""

from __future__ import annotations

import keyword
import sys
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

from pydantic import AfterValidator, Field, PositiveInt, model_validator

from pyml.spec.layers import (
    MLP,
    Attention,
    BlockResidual,
    DecoderBlock,
    Embedding,
    Identifier,
    LayerNorm,
    Linear,
    LMHead,
    LoRA,
    Residual,
    RMSNorm,
    SequentialLayer,
    SoftmaxCrossEntropy,
    Strict,
)
from pyml.spec.shapes import IDS, Mismatch, Node, Shape, check_chain

# A project's generated package is `gen/<name>/`, imported as `gen.<name>` from the project: the
# name must be importable and must not shadow a module a user or pyml imports.
RESERVED_NAMES = frozenset({"gen", "pyml"}) | frozenset(sys.stdlib_module_names)


def usable_package_name(name: str) -> str:
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise ValueError(f"'{name}' is a Python keyword, so `import gen.{name}` would fail; "
                         "choose another name")
    if name in RESERVED_NAMES:
        raise ValueError(f"'{name}' would shadow the module '{name}' that Python or pyml imports; "
                         "choose another name")
    return name


PackageName = Annotated[Identifier, AfterValidator(usable_package_name)]


def layer_name(layer, place: str) -> str:
    return layer.name if getattr(layer, "name", None) else place


def sequential_node(layer, place: str) -> Node:
    name = layer_name(layer, place)
    if isinstance(layer, Linear):
        return Node(name, layer.in_features, layer.out_features)
    if isinstance(layer, (RMSNorm, LayerNorm)):
        return Node(name, layer.dim, layer.dim)
    if isinstance(layer, Residual):
        body = tuple(sequential_node(inner, f"{name}.body[{i}]") for i, inner in enumerate(layer.body))
        return Node(name, None, None, body)
    return Node(name, None, None)  # element-wise activation: any features, same out


class SequentialModel(Strict):
    """A stack of layers applied in order to a (B, input_dim) batch, ending in a loss over
    output_dim classes."""

    form: Literal["sequential"]
    name: PackageName
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


@dataclass(frozen=True)
class BlockItem:
    """One layer of a decoder block: `label` is where the spec declares it (for messages), `name`
    its identifier in generated code and tensor names (`model.layers.{l}.<name>...`)."""

    label: str
    name: str
    layer: RMSNorm | LayerNorm | Attention | MLP | BlockResidual
    body: tuple[BlockItem, ...] = ()


def block_dims(layer) -> int | None:
    return None if isinstance(layer, BlockResidual) else layer.dim


class DecoderModel(Strict):
    """A decoder: embedding, `block.count` blocks, final norm, LM head."""

    form: Literal["decoder"]
    name: PackageName
    max_seq_len: PositiveInt
    embedding: Embedding
    block: DecoderBlock
    final_norm: RMSNorm
    lm_head: LMHead
    loss: SoftmaxCrossEntropy = SoftmaxCrossEntropy()
    lora: LoRA | None = None

    batch: ClassVar[tuple[str, ...]] = ("B", "T")

    @model_validator(mode="after")
    def lora_rank_fits(self) -> DecoderModel:
        """A rank above a projection's smaller dim adds parameters and no expressiveness."""
        if self.lora is None:
            return self
        found = [target for item in _items(self.block_items())
                 for target, _, _ in projections(item.layer)]
        if not set(found) & set(self.lora.targets):
            raise ValueError(f"lora.targets {self.lora.targets} name no projection of the block "
                             f"(it has {sorted(set(found)) or 'none'}): nothing would train")
        for item in _items(self.block_items()):
            for target, fan_in, fan_out in projections(item.layer):
                if target in self.lora.targets and self.lora.rank > min(fan_in, fan_out):
                    raise ValueError(
                        f"lora.rank {self.lora.rank} exceeds {item.label}'s {target} projection "
                        f"({fan_in} -> {fan_out}); choose a rank of at most {min(fan_in, fan_out)}")
        return self

    @model_validator(mode="after")
    def block_names_unique(self) -> DecoderModel:
        seen: dict[str, str] = {}

        def visit(items) -> None:
            for item in items:
                if item.name in seen:
                    raise ValueError(f"{item.label} and {seen[item.name]} are both named "
                                     f"'{item.name}'; names in a block must be unique")
                seen[item.name] = item.label
                visit(item.body)

        visit(self.block_items())
        return self

    def block_items(self) -> tuple[BlockItem, ...]:
        """The block's layers, resolved: an unnamed layer is named after its kind and its place
        among the block's layers of that kind (`rmsnorm0`, `attention0`), and labelled by where
        the spec declares it (`block.layers[0].body[1]`)."""
        counts: dict[str, int] = {}

        def resolve(label: str, layer) -> BlockItem:
            if self.block.layers is not None and layer.name:
                label = f"block.{layer.name}"  # a named layer is called by its name, as in MLPs
            name = layer.name
            if name is None:
                index = counts.get(layer.kind, 0)
                counts[layer.kind] = index + 1
                name = f"{layer.kind}{index}"
            body = ()
            if isinstance(layer, BlockResidual):
                labels = self.block.body_labels(label, layer)
                body = tuple(resolve(inner_label, inner)
                             for inner_label, inner in zip(labels, layer.body))
            return BlockItem(label, name, layer, body)

        return tuple(resolve(label, layer) for label, layer in self.block.composition())

    def attentions(self) -> list[Attention]:
        found: list[Attention] = []

        def visit(items) -> None:
            for item in items:
                if isinstance(item.layer, Attention):
                    found.append(item.layer)
                visit(item.body)

        visit(self.block_items())
        return found

    def nodes(self) -> list[Node]:
        def node(item: BlockItem) -> Node:
            if item.body:
                return Node(item.label, None, None, tuple(node(inner) for inner in item.body))
            return Node(item.label, block_dims(item.layer), block_dims(item.layer))

        return [
            Node("embedding", IDS, self.embedding.dim),
            *(node(item) for item in self.block_items()),
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


def _items(items):
    for item in items:
        yield item
        yield from _items(item.body)


def projections(layer) -> list[tuple[str, int, int]]:
    """(LoRA target, fan in, fan out) of each projection a block layer holds."""
    if isinstance(layer, Attention):
        q_dim, kv_dim = layer.n_heads * layer.head_dim, layer.n_kv_heads * layer.head_dim
        qkv = ([("qkv", layer.dim, q_dim + 2 * kv_dim)] if layer.fused_qkv else
               [("q", layer.dim, q_dim), ("k", layer.dim, kv_dim), ("v", layer.dim, kv_dim)])
        return [*qkv, ("o", q_dim, layer.dim)]
    if isinstance(layer, MLP):
        gate_up = ([("gate_up", layer.dim, 2 * layer.hidden)] if layer.fused_gate_up else
                   [("gate", layer.dim, layer.hidden), ("up", layer.dim, layer.hidden)])
        return [*gate_up, ("down", layer.hidden, layer.dim)]
    return []


ModelSpec = Annotated[Union[SequentialModel, DecoderModel], Field(discriminator="form")]
