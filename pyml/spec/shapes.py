"""Shape inference and the junction-by-junction check.

A model is flattened into a chain of `Node`s. Each node says which feature dim it needs at its input
(or None when it takes whatever comes, like an activation) and which it produces. The check walks the
chain carrying the current shape and reports every junction where the two sides disagree. After a
mismatch it carries on from the node's declared output, so one wrong dim is reported at exactly one
junction and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """Symbolic batch dims (like ("B", "T")) and a concrete feature dim; ids carry no feature dim."""

    batch: tuple[str, ...]
    features: int | None

    def __str__(self) -> str:
        if self.features is None:
            return f"Ids<{', '.join(self.batch)}>"
        dims = ", ".join([*self.batch, str(self.features)])
        return f"Mat<{dims}>" if len(self.batch) == 1 else f"Tensor<{dims}>"


IDS = "ids"


@dataclass(frozen=True)
class Node:
    """One layer as the shape check sees it.

    `needs` is the feature dim the layer reads (None: any float features; IDS: token ids);
    `gives` is the feature dim it writes (None: the same as it read). A residual node has a `body`,
    checked from the residual's input, whose output must have the residual's input shape again.
    """

    name: str
    needs: int | None | str
    gives: int | None
    body: tuple[Node, ...] = ()



@dataclass(frozen=True)
class Mismatch:
    before: str
    after: str
    expected: Shape
    observed: Shape

    def __str__(self) -> str:
        return (
            f"shape mismatch between '{self.before}' and '{self.after}': "
            f"expected {self.expected}, observed {self.observed}"
        )


def check_chain(batch: tuple[str, ...], source: Shape, source_name: str,
                chain: tuple[Node, ...] | list[Node]) -> tuple[list[Mismatch], Shape, str]:
    """Every junction of `source -> chain[0] -> ... -> chain[-1]` whose dims disagree, with the
    shape and name at the end of the chain."""
    mismatches: list[Mismatch] = []
    current, previous = source, source_name
    for node in chain:
        expected = Shape(batch, None if node.needs in (None, IDS) else node.needs)
        reads_ids = node.needs == IDS
        if reads_ids != (current.features is None) or (
            isinstance(node.needs, int) and node.needs != current.features
        ):
            mismatches.append(Mismatch(previous, node.name, expected, current))
            current = expected
        if node.body:
            body_mismatches, body_out, body_last = check_chain(batch, current, node.name, node.body)
            mismatches += body_mismatches
            if body_out != current:
                mismatches.append(Mismatch(body_last, f"{node.name} (skip)", current, body_out))
        if node.gives is not None:
            current = Shape(batch, node.gives)
        if node.gives is not None or isinstance(node.needs, int) or node.body:
            # an element-wise layer passes features through; the junction is named after the
            # layer that fixed the dim
            previous = node.name
    return mismatches, current, previous
