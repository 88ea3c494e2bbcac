"""What the generated passes are made of: calls to kernels, with structured arguments.

An op kind (`pyml.codegen.kinds`) writes each of its passes as a list of `Call`s whose arguments
say what they are (an activation, a gradient, a parameter...) rather than how the pass spells them.
Each pass (`pyml.codegen.schedule`'s training forward and backward and decoding step,
`pyml.codegen.decode_source`'s fused step) spells them its own way, and reads from the same
arguments which buffers it must allocate: no statement text is parsed back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Act:
    """The value `value` as the pass holds it: `s.x[l]` in training, `c.x` while decoding."""

    value: str


@dataclass(frozen=True)
class Grad:
    """The gradient of the value `value`."""

    value: str


@dataclass(frozen=True)
class Scratch:
    """A scratch buffer the shape of `value`'s gradient, where an adjoint writes before its
    result is added or copied into the gradient."""

    value: str


@dataclass(frozen=True)
class Weight:
    """The parameter `attr` (indexed by the layer when it is per layer)."""

    attr: str


@dataclass(frozen=True)
class WeightGrad:
    """The gradient of the parameter `attr`; a frozen parameter's is a scratch buffer."""

    attr: str


@dataclass(frozen=True)
class StepInput:
    """A parameter of the fused decoding step, named `name`, supplied by the Python expression
    `source` (`decode_source.Argument`); `index` is what the step indexes it with."""

    name: str
    source: str
    index: str = ""


@dataclass(frozen=True)
class Code:
    """An expression written as it is: a constant, `position`, `cos`."""

    text: str


Arg = Act | Grad | Scratch | Weight | WeightGrad | StepInput | Code


@dataclass(frozen=True)
class Call:
    """`results = fn(args)`; `fn` is a kernel of the package's module (`k.name`) or a name the
    pass has in scope."""

    fn: str
    args: tuple[Arg, ...] = ()
    results: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comment:
    text: str


Statement = Call | Comment


def kernel(prefix: str, suffix: str, *args: Arg) -> Call:
    """A call of the op's own kernel `{prefix}_{suffix}` in the kernel module."""
    return Call(f"k.{prefix}_{suffix}", tuple(args))


def arguments(statements: list[Statement]) -> list[Arg]:
    return [arg for statement in statements if isinstance(statement, Call) for arg in statement.args]
