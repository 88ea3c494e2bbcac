"""Scheduling: from the graph (`pyml.codegen.ir`) to the statements of the generated model.

Three passes are written from one op list, each op by its kind (`pyml.codegen.kinds`):
- the training forward, which saves per layer what the backward reads (each kind says what that is);
- the backward, the ops' adjoints in reverse order (Lean law `compose_adjoint`), where each value's
  gradient is written by the first adjoint that reaches it and added to by the others (a fan-out,
  Lean law `residual_adjoint`). A residual join passes its gradient on unchanged, so the gradients of
  its two inputs share its gradient's buffer instead of being copies; an adjoint that cannot add
  into a buffer that already holds a gradient writes a scratch buffer that is then added;
- the decoding step, the forward on one new position per sequence with a KV cache.

Buffers are named after their storage: `s.<storage>` in the activations (with `[a]` when saved per
layer: slot a is layer l's own, or in recompute mode the one slot every layer shares), `g.<storage>`
for gradients, `c.<storage>` in the decoding buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyml.codegen.calls import (
    Act,
    Arg,
    Call,
    Code,
    Comment,
    Grad,
    Scratch,
    Statement,
    Weight,
    WeightGrad,
    arguments,
)
from pyml.codegen.ir import Graph, Op
from pyml.codegen.kinds import kind_of
from pyml.codegen.passes import fuse_residual_norms


@dataclass
class Layout:
    """Where every storage lives: `saved` storages are kept per layer for the backward;
    `grad_home[storage]` is the gradient buffer its gradient is written in ("stream" for the
    residual stream's one buffer, "in_place" for the logits, which the loss overwrites with their
    gradient)."""

    saved: set[str]
    grad_home: dict[str, str]

    def grad_storages(self) -> list[str]:
        return sorted({home for home in self.grad_home.values() if home not in ("stream", "in_place")})


def region(graph: Graph, value: str) -> tuple:
    """The part of its storage a value covers, for tracking which gradients are written; the
    stream's values are told apart by position."""
    view = graph.values[value]
    if graph.storages[view.storage].scope == "stream":
        return view.storage, view.position
    if view.view in ("heads", "row_heads"):
        return view.storage, view.start, view.stop
    return view.storage, 0, -1


class Writer:
    """Expressions for values in the training pass (`s.`) and the decoding step (`c.`). A saved
    storage is indexed by `slot`: "a" in the passes (`Activations.slot(l)`, which recompute mode
    makes one slot for every layer), "l" where every layer's slot is kept (`fill_cache`)."""

    def __init__(self, graph: Graph, saved: set[str], slot: str = "a"):
        self.graph, self.saved, self.slot = graph, saved, slot

    def activation(self, value: str) -> str:
        view = self.graph.values[value]
        storage = self.graph.storages[view.storage]
        if storage.scope == "stream":
            return {"in": "s.stream[l]", "out": "s.stream[l + 1]", "first": "s.stream[0]",
                    "last": "s.stream[-1]"}[view.position]
        per_layer = storage.scope == "block" and storage.name in self.saved
        return f"s.{value}[{self.slot}]" if per_layer else f"s.{value}"

    def decoding(self, value: str) -> str:
        view = self.graph.values[value]
        if self.graph.storages[view.storage].scope == "stream":
            # one buffer a layer reads and one it writes, swapped after each layer
            return {"in": "c.stream_in", "out": "c.stream_out", "first": "c.stream_in",
                    "last": "c.stream_in"}[view.position]
        return f"c.{value}"


class Backward:
    """The reverse walk's state, which each kind's adjoint reads and advances (`BackwardEnv`):
    which gradient regions and parameter gradients hold a value, and where each one lives."""

    def __init__(self, graph: Graph, layout: Layout, writer: Writer):
        self.graph, self.layout, self.writer = graph, layout, writer
        self.written: set[tuple] = set()
        self.param_written: set[str] = set()
        self.scratch: list[str] = []  # values whose gradient also needs a scratch buffer

    def home(self, value: str) -> str:
        return self.layout.grad_home[self.graph.values[value].storage]

    def mode(self, value: str) -> str:
        """"write" for a value's first gradient contribution, "add" for the others."""
        key = region(self.graph, value)
        if key in self.written:
            return "add"
        self.written.add(key)
        return "write"

    def param_mode(self, attr: str) -> str:
        if attr in self.param_written:
            return "add"
        self.param_written.add(attr)
        return "write"

    def trainable(self, attr: str) -> bool:
        return graph_param(self.graph, attr).trainable

    def input_gradient(self, op: Op, index: int, can_add: bool) -> tuple[Arg, list[Statement], str]:
        """(the buffer the kernel writes input `index`'s gradient into, the statements after it,
        the kernel's suffix). The gradient is written (its first contribution) or added; where the
        kernel cannot add, or where its buffer is the output gradient's own (a kernel must not
        read and write one buffer), the kernel writes a scratch buffer that is then copied or
        added."""
        name = op.inputs[index]
        mode = self.mode(name)
        shares_buffer = op.outputs and self.home(name) == self.home(op.outputs[0])
        if not shares_buffer and mode == "write":
            return Grad(name), [], "backward"
        if not shares_buffer and can_add:
            return Grad(name), [], "backward_add"
        self.scratch.append(name)
        join = "k.add_into" if mode == "add" else "k.copy_into"
        return Scratch(name), [Call(join, (Grad(name), Scratch(name)))], "backward"

    def param_grads(self, op: Op, trainable_only: bool = False) -> list[WeightGrad]:
        """The gradients of the op's parameters (each written once: no parameter is shared by two
        ops that have gradients); a frozen one's is a scratch buffer, unless `trainable_only`."""
        attrs = [attr for attr in op.params.values() if self.trainable(attr) or not trainable_only]
        for attr in attrs:
            if self.trainable(attr) and self.param_mode(attr) == "add":
                raise AssertionError(f"{op.prefix}: a second gradient into {attr}")
        return [WeightGrad(attr) for attr in attrs]

    def spell(self, arg: Arg) -> str:
        if isinstance(arg, Grad):
            return f"s.{arg.value}" if self.home(arg.value) == "in_place" else f"g.{arg.value}"
        if isinstance(arg, Scratch):
            return f"g.scratch_{arg.value}"
        if isinstance(arg, WeightGrad):
            return param_expr(self.graph, arg.attr, "gr")
        return spell_forward(self.graph, arg, self.writer.activation)


class ForwardPass:
    """A forward pass of the model (`ForwardEnv`): "train" writes activations `s.`, saved per layer
    where the backward reads them; "decode" writes the decoding buffers `c.`."""

    target = ""

    def __init__(self, graph: Graph, writer: Writer, mode: str):
        self.graph, self.writer, self.mode = graph, writer, mode

    def attention_index(self, op: Op) -> int:
        return cache_index(self.graph, op)

    def spell(self, arg: Arg) -> str:
        value = self.writer.activation if self.mode == "train" else self.writer.decoding
        return spell_forward(self.graph, arg, value)


def spell_forward(graph: Graph, arg: Arg, value) -> str:
    if isinstance(arg, Act):
        return value(arg.value)
    if isinstance(arg, Weight):
        return param_expr(graph, arg.attr)
    if isinstance(arg, Code):
        return arg.text
    raise TypeError(f"{arg!r} has no spelling in a forward pass")


def render(statements: list[Statement], spell) -> list[str]:
    """The Python text of `statements`, each argument spelled by `spell`."""
    lines = []
    for statement in statements:
        if isinstance(statement, Comment):
            lines.append(f"# {statement.text}")
            continue
        call = f"{statement.fn}({', '.join(spell(arg) for arg in statement.args)})"
        lines.append(f"{', '.join(statement.results)} = {call}" if statement.results else call)
    return lines


def plan_layout(graph: Graph) -> Layout:
    """Saved storages, and each gradient's buffer. A residual join `out = x + body(x)` passes its
    output gradient to both inputs: the body's output takes the join's gradient buffer (it reads it
    once, at its producer), and so does the skip input x, whose gradient then accumulates there,
    where nothing after the join has written x's gradient yet. Walking in reverse, a chain of
    joins (the residual stream) shares one buffer. When the body ends in another join, its output
    gets a copy in a buffer of its own instead: that inner join hands its buffer on to its own
    skip, whose gradient accumulates there while x's is still accumulating in the outer one."""
    saved: set[str] = set()
    for op in graph.ops():
        reads = kind_of(op).reads(op)
        if "inputs" in reads:
            saved |= {graph.values[v].storage for v in op.inputs}
        if "aux" in reads:
            saved |= set(op.aux.values())
    grad_home = {name: "stream" if storage.scope == "stream" else name
                 for name, storage in graph.storages.items() if storage.dtype == "float"}
    grad_home[graph.values[graph.logits].storage] = "in_place"
    producers = {value: op for op in graph.ops() for value in op.outputs}
    for ops in (graph.tail, graph.block, graph.head):
        touched: set[str] = set()
        for op in reversed(ops):
            inputs = [graph.values[v] for v in op.inputs if graph.values[v].storage in grad_home]
            if op.kind == "residual":
                home = grad_home[graph.values[op.outputs[0]].storage]
                skip, body_out = op.inputs
                nested = producers[body_out].kind == "residual"
                for value in inputs:
                    if value.name == body_out and nested:
                        continue
                    if (value.view == "" and value.storage not in touched
                            and grad_home[value.storage] != "stream"):
                        grad_home[value.storage] = home
            touched |= {value.storage for value in inputs}
    return Layout(saved, grad_home)


@dataclass
class Statements:
    """The passes' statements as lines of Python, and the arguments of the backward's and the
    decoding step's calls, from which the buffers they use are allocated."""

    forward_head: list[str]
    forward_block: list[str]
    forward_tail: list[str]
    backward_tail: list[str]
    backward_block: list[str]
    backward_head: list[str]
    decode_head: list[str]
    decode_block: list[str]
    decode_tail: list[str]
    scratch: list[str]  # values whose gradient also needs a scratch buffer of its shape
    backward_args: list[Arg]
    decode_args: list[Arg]


def forward_statements(ops: list[Op], env) -> list[Statement]:
    """Forward statements of `ops` (one of head, block, tail) in the pass `env`, fusions applied."""
    return [statement for op in fuse_residual_norms(ops) for statement in kind_of(op).forward(op, env)]


def graph_param(graph: Graph, attr: str):
    return next(param for param in graph.params if param.attr == attr)


def param_expr(graph: Graph, attr: str, root: str = "p") -> str:
    """A parameter (root "p") or its gradient (root "gr"); a frozen parameter has no gradient, and
    a kernel that computes one anyway (a norm's gain) writes it to a scratch buffer `g.frozen_*`."""
    param = graph_param(graph, attr)
    if root == "gr" and not param.trainable:
        return f"g.frozen_{attr}"
    return f"{root}.{attr}[l]" if param.per_layer else f"{root}.{attr}"


def cache_index(graph: Graph, op: Op) -> int:
    return [o for o in graph.block if o.kind == "attention"].index(op)


def trainable_params(graph: Graph, op: Op) -> list[str]:
    return [attr for attr in op.params.values() if graph_param(graph, attr).trainable]


def backward_statements(graph: Graph, ops: list[Op], state: Backward,
                        bucket_per_op: bool = False) -> list[Statement]:
    """The adjoints of `ops` in reverse order, each under a comment naming its Lean laws; with
    `bucket_per_op` (a sequential model), `ready(i)` after each op that finished its trainable
    parameters' gradients."""
    statements: list[Statement] = []
    bucket = 0
    for op in reversed(ops):
        laws = sorted({instance.law for instance in op.instances})
        statements.append(Comment(f"{op.prefix} ({op.kind})" + (f"; Lean: {', '.join(laws)}" if laws else "")))
        statements += kind_of(op).adjoint(op, state)
        if bucket_per_op and trainable_params(graph, op):
            statements.append(ready(str(bucket)))
            bucket += 1
    return statements


def ready(bucket: str) -> Call:
    return Call("ready", (Code(bucket),))


def bucket_groups(graph: Graph) -> dict[str, list]:
    """A decoder's trainable parameters before the block, in it, and after it (creation order)."""
    trainable = [p for p in graph.params if p.trainable]
    first = next((i for i, p in enumerate(graph.params) if p.per_layer), len(graph.params))
    before = [p for p in graph.params[:first] if p.trainable]
    return {"before": before, "block": [p for p in trainable if p.per_layer],
            "after": [p for p in graph.params[first:] if p.trainable and not p.per_layer]}


def schedule(graph: Graph) -> tuple[Layout, Statements]:
    layout = plan_layout(graph)
    writer = Writer(graph, layout.saved)
    train, decode = ForwardPass(graph, writer, "train"), ForwardPass(graph, writer, "decode")
    state = Backward(graph, layout, writer)
    sequential = graph.form == "sequential"
    backward_tail = backward_statements(graph, graph.tail, state)
    # every layer runs the block's adjoints from the same state: its output gradient written
    state.written.add(("stream", "out"))
    backward_block = backward_statements(graph, graph.block, state)
    state.written.add(("stream", "first"))
    backward_head = backward_statements(graph, graph.head, state, bucket_per_op=sequential)
    if not sequential:
        # a decoder's buckets, as ParameterLayout.buckets lays them out: the trainable parameters
        # after the block (the final norm, an untied head), each layer's from the last, then those
        # before it (the embedding, which a tied head's gradient also reaches)
        groups = bucket_groups(graph)
        first_layer = 1 if groups["after"] else 0
        if groups["after"]:
            backward_tail.append(ready("0"))
        if groups["block"]:
            backward_block.append(ready(f"{first_layer} + N_LAYERS - 1 - l"))
        if groups["before"]:
            backward_head.append(ready(f"{first_layer} + {'N_LAYERS' if groups['block'] else 0}"))
    decoding = [forward_statements(ops, decode) for ops in (graph.head, graph.block, graph.tail)]
    return layout, Statements(
        *(render(forward_statements(ops, train), train.spell)
          for ops in (graph.head, graph.block, graph.tail)),
        *(render(statements, state.spell) for statements in (backward_tail, backward_block, backward_head)),
        *(render(statements, decode.spell) for statements in decoding),
        scratch=list(dict.fromkeys(state.scratch)),
        backward_args=arguments([*backward_tail, *backward_block, *backward_head]),
        decode_args=arguments([statement for statements in decoding for statement in statements]),
    )


def training_memory(graph: Graph, layout: Layout, B: int, T: int, itemsize: int,
                    recompute: bool = False) -> dict[str, int]:
    """Bytes a training step at batch (B, T) holds: parameters, the trainable ones' gradients and
    AdamW's two moments, a decoder's RoPE tables (cos and sin at every position up to max_seq_len), the
    activations (per layer where the backward reads them, once with `recompute`: the backward
    runs each block again from its input in the stream) and the gradient buffers."""
    sizes = {"B": B, "T": T, "N": B * T}

    def count(shape: tuple) -> int:
        return math.prod(sizes.get(dim, dim) if isinstance(dim, str) else dim for dim in shape)

    activations = 0
    for storage in graph.storages.values():
        copies = {"stream": graph.n_layers + 1,
                  "block": graph.n_layers if storage.name in layout.saved and not recompute
                  else 1}.get(storage.scope, 1)
        activations += count(storage.shape) * copies * (8 if storage.dtype == "int64" else itemsize)
    gradients = sum(count(graph.storages[home].shape) for home in layout.grad_storages())
    if "stream" in graph.storages:
        gradients += count(graph.storages["stream"].shape)
    params = graph.param_count() * itemsize
    trainable = graph.param_count(trainable=True) * itemsize  # a LoRA model's adapters
    positions = graph.constants.get("MAX_SEQ_LEN", 0)
    tables = sum(2 * positions * half * itemsize for _, half, _ in graph.rope_tables)
    parts = {"parameters": params, "gradients": trainable, "AdamW state": 2 * trainable}
    if tables:
        parts["RoPE tables"] = tables
    return parts | {"activations": activations + gradients * itemsize}
