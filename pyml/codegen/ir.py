"""The generator's intermediate form: storages, values, parameters and ops.

A spec lowers (`pyml.codegen.lower`) to a `Graph`: straight-line ops over values. A value is a view
of a storage (the whole of it, its rows flattened, or a range of its heads), so one buffer can be
read as (N, features) by a linear map and as (B, T, heads, head_dim) by attention. Each op names the
kernel that runs its forward and adjoint, the values it reads and writes, the parameters it uses,
the saved statistics it writes, and the Lean law instances its adjoint rests on.

`pyml.codegen.schedule` turns the graph into code: which storages the backward pass needs saved per
layer, where each gradient lives, and the statements of the forward, backward and decoding passes.
Shapes are symbolic in "B", "T" and "N" (= B * T rows) and concrete in every feature dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Where a storage lives: outside the repeated block ("model"), inside it ("block"), or the residual
# stream that carries one block's output to the next block's input ("stream").
SCOPES = ("model", "block", "stream")


@dataclass(frozen=True)
class Storage:
    name: str
    shape: tuple  # symbolic: ("B", "T", 15, 64) or ("N", 576)
    scope: str = "model"
    dtype: str = "float"  # "float" (the model's dtype) or "int64"


@dataclass(frozen=True)
class Value:
    """A view of `storage`: `view` is "" (all of it), "rows" (flattened to (N, features)),
    "heads" (heads `start:stop` of a (B, T, heads, head_dim) storage) or "row_heads" (the same
    heads with B and T merged: (N, heads, head_dim)). A value of the residual stream is the block's
    input ("in": stream[l]) or output ("out": stream[l + 1]), or, outside the block, the first
    block's input ("first") or the last one's output ("last")."""

    name: str
    storage: str
    shape: tuple
    view: str = ""
    start: int = 0
    stop: int = 0
    position: str = ""


@dataclass(frozen=True)
class Param:
    """A parameter tensor: its attribute on `Parameters`, its shape (without the layer axis when
    `per_layer`), how it is initialised, and its names in tensor files: one (name, row range)
    per tensor it holds, since fused projections stack several tensors as rows."""

    attr: str
    shape: tuple[int, ...]
    per_layer: bool
    init: str  # "normal", "uniform" (U(-1/sqrt(fan_in), 1/sqrt(fan_in))), "ones" or "zeros"
    tensors: tuple[tuple[str, int, int], ...]  # (external name, first row, last row + 1)
    fan_in: int = 0
    trainable: bool = True  # False: a frozen base weight of a LoRA model, without a gradient


@dataclass(frozen=True)
class Instance:
    """One Lean law at this spec's dims, named `{layer}_{law}` in the generated Lean file."""

    layer: str
    law: str
    dims: dict
    comment: str = ""


@dataclass
class Op:
    """One step of the forward pass.

    `kind` selects how its statements are written (`pyml.codegen.schedule`); `prefix` names its
    kernels in the kernel module (`{prefix}_forward`, `{prefix}_backward`); `params` and `aux` map
    a role ("weight", "bias", "rstd", "probs") to a parameter attribute or a storage."""

    kind: str
    prefix: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, str] = field(default_factory=dict)
    aux: dict[str, str] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    instances: tuple[Instance, ...] = ()


@dataclass(frozen=True)
class Link:
    """One link of the spec's Lean skeleton (the value path through the model): a dense layer
    (`dims` = (in, out)), an element-wise gain (`dims` = (width,)) or a residual around `body`."""

    kind: str  # "dense", "gain" or "residual"
    dims: tuple[int, ...] = ()
    body: tuple[Link, ...] = ()


@dataclass(frozen=True)
class Skeleton:
    """The spec's Lean skeleton: the links of `start`, then the decoder block's links composed
    `n_blocks` times (none for a sequential model), then those of `end`; from width `dims[0]` to
    `dims[1]`. `pyml.codegen.lean_instances` writes it as Lean terms."""

    start: tuple[Link, ...]
    block: tuple[Link, ...]
    n_blocks: int
    end: tuple[Link, ...]
    dims: tuple[int, int]


@dataclass
class Graph:
    """A lowered spec: the ops of the model in forward order (`head`, then `block` repeated
    `n_layers` times, then `tail`), the storages and values they use, the parameters, and the kernel
    blocks the kernel modules must define."""

    form: str  # "sequential" or "decoder"
    storages: dict[str, Storage]
    values: dict[str, Value]
    params: list[Param]
    head: list[Op]
    block: list[Op]
    tail: list[Op]
    n_layers: int
    kernel_blocks: list[tuple[str, dict]]
    constants: dict  # module constants of the generated model (dims, per-layer tables)
    skeleton: Skeleton
    input: str  # the value the batch is loaded into (ids or features)
    logits: str
    # (RoPE base, half head_dim, scaling as a dict or None) of each RoPE table
    rope_tables: list[tuple[float, int, dict | None]] = field(default_factory=list)
    attention_caches: list[dict] = field(default_factory=list)  # per attention op: cache layout

    def ops(self) -> list[Op]:
        return [*self.head, *self.block, *self.tail]

    def kernel_context(self, prefix: str) -> dict:
        """The dims and constants of the kernels of the op named `prefix`."""
        return next(context for _, context in self.kernel_blocks if context.get("p") == prefix)

    def param_count(self, trainable: bool | None = None) -> int:
        """Parameters in all, or only the trainable (or only the frozen) ones."""
        return sum(math.prod(p.shape) * (self.n_layers if p.per_layer else 1) for p in self.params
                   if trainable is None or p.trainable == trainable)
