"""The op kinds, one module each: everything the generator knows about a kind is there.

`docs/adding_a_kind.md` says how to add one.
"""

from __future__ import annotations

from pyml.codegen.ir import Op
from pyml.codegen.kinds import (
    attention,
    embedding,
    frozen_linear,
    geglu,
    gelu,
    head_rmsnorm,
    layernorm,
    linear,
    loss,
    relu,
    residual,
    rmsnorm,
    rope,
    silu,
    swiglu,
)
from pyml.codegen.kinds.base import Kind

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    linear.KIND, frozen_linear.KIND, embedding.KIND, attention.KIND, rope.KIND, rmsnorm.KIND,
    rmsnorm.FUSED, head_rmsnorm.KIND, layernorm.KIND, swiglu.KIND, geglu.KIND, relu.KIND, gelu.KIND, silu.KIND,
    residual.KIND, loss.KIND,
)}


def kind_of(op: Op) -> Kind:
    return KINDS[op.kind]
