"""Scheduling: from the graph (`pyml.codegen.ir`) to the statements of the generated model.

Three passes are written from one op list:
- the training forward, which saves per layer what the backward reads (each kind says what that is);
- the backward, the ops' adjoints in reverse order (Lean law `compose_adjoint`), where each value's
  gradient is written by the first adjoint that reaches it and added to by the others (a fan-out,
  Lean law `residual_adjoint`). A residual join passes its gradient on unchanged, so the gradients of
  its two inputs share its gradient's buffer instead of being copies; an adjoint that cannot add
  into a buffer that already holds a gradient writes a scratch buffer that is then added;
- the decoding step, the forward on one new position per sequence with a KV cache.

Buffers are named after their storage: `s.<storage>` in the activations (with `[l]` when saved per
layer), `g.<storage>` for gradients, `c.<storage>` in the decoding buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyml.codegen.ir import Graph, Op

# What each kind's adjoint reads besides the output gradient: its inputs ("inputs") and/or its saved
# statistics ("aux"). Values a backward reads must be saved per layer.
BACKWARD_READS = {
    "linear": ("inputs",), "rmsnorm": ("inputs", "aux"), "head_rmsnorm": ("inputs", "aux"),
    "rope": (), "attention": ("inputs", "aux"), "swiglu": ("inputs",), "geglu": ("inputs",),
    "relu": ("inputs",), "gelu": ("inputs",), "silu": ("inputs",), "residual": (),
    "embedding": ("inputs",), "loss": (),
    # a frozen linear map's adjoint reads its input only for its adapters' gradients
    "frozen_linear": ("inputs", "aux"),
}
# Kinds whose adjoint can add its input gradient into a buffer (`{prefix}_backward_add`).
ADDS_INPUT_GRADIENT = {"rmsnorm"}


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
    """Expressions for values in the training pass (`s.`) and the decoding step (`c.`)."""

    def __init__(self, graph: Graph, saved: set[str]):
        self.graph, self.saved = graph, saved

    def activation(self, value: str) -> str:
        view = self.graph.values[value]
        storage = self.graph.storages[view.storage]
        if storage.scope == "stream":
            return {"in": "s.stream[l]", "out": "s.stream[l + 1]", "first": "s.stream[0]",
                    "last": "s.stream[-1]"}[view.position]
        per_layer = storage.scope == "block" and storage.name in self.saved
        return f"s.{value}[l]" if per_layer else f"s.{value}"

    def decoding(self, value: str) -> str:
        view = self.graph.values[value]
        if self.graph.storages[view.storage].scope == "stream":
            # one buffer a layer reads and one it writes, swapped after each layer
            return {"in": "c.stream_in", "out": "c.stream_out", "first": "c.stream_in",
                    "last": "c.stream_in"}[view.position]
        return f"c.{value}"


class Backward:
    """State of the reverse walk: which gradient regions and parameter gradients hold a value."""

    def __init__(self, graph: Graph, layout: Layout):
        self.graph, self.layout = graph, layout
        self.written: set[tuple] = set()
        self.param_written: set[str] = set()

    def home(self, value: str) -> str:
        return self.layout.grad_home[self.graph.values[value].storage]

    def gradient(self, value: str) -> str:
        return f"s.{value}" if self.home(value) == "in_place" else f"g.{value}"

    def mode(self, value: str) -> str:
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
        reads = BACKWARD_READS[op.kind]
        if op.kind == "frozen_linear" and not op.attrs["adapters"]:
            reads = ()
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


def call(prefix: str, suffix: str, *args: str) -> str:
    return f"k.{prefix}_{suffix}({', '.join(args)})"


def layer_table(op: Op, key: str) -> str:
    return f"{op.attrs[key]}[l]"


def forward_lines(graph: Graph, ops: list[Op], value, mode: str) -> list[str]:
    """Forward statements of `ops`; `value` maps a value to its expression; mode is "train" or
    "decode". A residual join followed by the RMSNorm that reads it is one fused call."""
    lines: list[str] = []
    skip = False
    for index, op in enumerate(ops):
        if skip:
            skip = False
            continue
        following = ops[index + 1] if index + 1 < len(ops) else None
        x = [value(v) for v in op.inputs]
        y = [value(v) for v in op.outputs]
        p = [param_expr(graph, attr) for attr in op.params.values()]
        aux = [value(a) for a in op.aux.values()]
        if (op.kind == "residual" and following is not None and following.kind == "rmsnorm"
                and following.inputs[0] == op.outputs[0]):
            norm = following
            w = param_expr(graph, norm.params["weight"])
            lines.append(call(norm.prefix, "forward_residual", *x, *y, w, value(norm.outputs[0]),
                              value(norm.aux["rstd"])))
            skip = True
        elif op.kind == "residual":
            lines.append(f"k.residual_add({x[0]}, {x[1]}, {y[0]})")
        elif op.kind == "embedding":
            lines.append(call(op.prefix, "forward", x[0], *p, y[0]))
        elif op.kind in ("rmsnorm", "head_rmsnorm"):
            lines.append(call(op.prefix, "forward", x[0], *p, y[0], *aux))
        elif op.kind == "linear":
            lines.append(call(op.prefix, "forward", x[0], *p, y[0]))
        elif op.kind == "frozen_linear":
            lines.append(call(op.prefix, "forward", x[0], *p, y[0], *aux))
        elif op.kind == "rope":
            offset = "position" if mode == "decode" else "0"
            lines.append(f"cos, sin = self.rope[{layer_table(op, 'tables')}]")
            lines.append(call(op.prefix, "forward", x[0], "cos", "sin", offset))
        elif op.kind == "attention":
            window = layer_table(op, "window")
            if mode == "decode":
                lines.append(f"slot, n_valid = c.cache_slot({cache_index(graph, op)}, l, position)")
                lines.append(f"kc, vc = c.keys[{cache_index(graph, op)}][l], "
                             f"c.values[{cache_index(graph, op)}][l]")
                lines.append(f"kc[:, slot] = {x[1]}[:, 0]")
                lines.append(f"vc[:, slot] = {x[2]}[:, 0]")
                lines.append(call(op.prefix, "decode", x[0], "kc", "vc", "n_valid", y[0]))
            else:
                lines.append(call(op.prefix, "forward", *x, *aux, y[0], window))
        elif op.kind == "loss":
            continue
        else:  # element-wise: the GLUs and the activations
            lines.append(call(op.prefix, "forward", x[0], y[0]))
    return lines


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


def backward_lines(graph: Graph, ops: list[Op], state: Backward, value, scratch,
                   bucket_per_op: bool = False) -> list[str]:
    """The adjoints of `ops` in reverse order, each under a comment naming its Lean laws; with
    `bucket_per_op` (a sequential model), `ready(i)` after each op that finished its trainable
    parameters' gradients."""
    lines: list[str] = []
    bucket = 0
    for op in reversed(ops):
        laws = sorted({instance.law for instance in op.instances})
        lines.append(f"# {op.prefix} ({op.kind})" + (f"; Lean: {', '.join(laws)}" if laws else ""))
        lines += adjoint(graph, op, state, value, scratch)
        if bucket_per_op and trainable_params(graph, op):
            lines.append(f"ready({bucket})")
            bucket += 1
    return lines


def adjoint(graph: Graph, op: Op, state: Backward, value, scratch: list) -> list[str]:
    """The statements of `op`'s adjoint. An input gradient is written (its first contribution) or
    added; where the kernel cannot add, or where its buffer is the output gradient's own (a kernel
    must not read and write one buffer), the kernel writes a scratch buffer that is then copied or
    added."""
    g = state.gradient
    x = [value(v) for v in op.inputs]
    aux = [value(a) for a in op.aux.values()]
    dy = g(op.outputs[0]) if op.outputs else ""

    def param_grads(trainable_only: bool = False) -> list[str]:
        attrs = [attr for attr in op.params.values()
                 if graph_param(graph, attr).trainable or not trainable_only]
        for attr in attrs:
            if graph_param(graph, attr).trainable and state.param_mode(attr) == "add":
                raise AssertionError(f"{op.prefix}: a second gradient into {attr}")
        return [param_expr(graph, attr, "gr") for attr in attrs]

    def input_gradient(index: int, can_add: bool) -> tuple[str, list[str], str]:
        """(the buffer the kernel writes, the statements after it, the kernel's suffix)."""
        name = op.inputs[index]
        target, mode = g(name), state.mode(name)
        shares_buffer = op.outputs and state.home(name) == state.home(op.outputs[0])
        if not shares_buffer and mode == "write":
            return target, [], "backward"
        if not shares_buffer and can_add:
            return target, [], "backward_add"
        scratch.append(name)
        temporary = f"g.scratch_{name}"
        join = "add_into" if mode == "add" else "copy_into"
        return temporary, [f"k.{join}({target}, {temporary})"], "backward"

    if op.kind == "loss":
        state.mode(op.inputs[0])
        return [f"loss = k.loss_forward_backward({x[0]}, s.targets, {g(op.inputs[0])})"]
    if op.kind == "residual":
        lines = []
        for name in op.inputs:
            mode = state.mode(name)
            if mode == "add":
                lines.append(f"k.add_into({g(name)}, {dy})")
            elif state.home(name) != state.home(op.outputs[0]):
                lines.append(f"k.copy_into({g(name)}, {dy})")
        return lines
    if op.kind == "rope":  # in place: the rotated gradient replaces the gradient of the rotation
        return [f"cos, sin = self.rope[{layer_table(op, 'tables')}]",
                call(op.prefix, "backward", dy, "cos", "sin")]
    if op.kind == "embedding":
        attr = op.params["weight"]
        if not graph_param(graph, attr).trainable:
            return []  # a frozen embedding: its gradient is nobody's
        first = state.param_mode(attr) == "write"
        grad = param_expr(graph, attr, "gr")
        return ([f"dev.zero({grad})"] if first else []) + [call(op.prefix, "backward", x[0], dy, grad)]
    if op.kind == "attention":
        dq, dk, dv = (input_gradient(i, False) for i in range(3))
        return [call(op.prefix, "backward", *x, *aux, dy, dq[0], dk[0], dv[0],
                     layer_table(op, "window")), *dq[1], *dk[1], *dv[1]]
    weight = [param_expr(graph, op.params["weight"])] if "weight" in op.params else []
    dx, after, suffix = input_gradient(0, op.kind in ADDS_INPUT_GRADIENT)
    if op.kind == "frozen_linear":
        params = [param_expr(graph, attr) for attr in op.params.values()]
        line = call(op.prefix, suffix, x[0], *params, *aux, dy, dx, *param_grads(trainable_only=True))
    elif op.kind == "linear":
        line = call(op.prefix, suffix, x[0], *weight, dy, dx, *param_grads())
    elif op.kind in ("rmsnorm", "head_rmsnorm"):
        line = call(op.prefix, suffix, x[0], *weight, *aux, dy, dx, *param_grads())
    else:  # element-wise
        line = call(op.prefix, suffix, x[0], dy, dx)
    return [line, *after]


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
    train, decode = writer.activation, writer.decoding
    state = Backward(graph, layout)
    scratch: list[str] = []
    sequential = graph.form == "sequential"
    backward_tail = backward_lines(graph, graph.tail, state, train, scratch)
    # every layer runs the block's adjoints from the same state: its output gradient written
    state.written.add(("stream", "out"))
    backward_block = backward_lines(graph, graph.block, state, train, scratch)
    state.written.add(("stream", "first"))
    backward_head = backward_lines(graph, graph.head, state, train, scratch, bucket_per_op=sequential)
    if not sequential:
        # a decoder's buckets, as ParameterLayout.buckets lays them out: the trainable parameters
        # after the block (the final norm, an untied head), each layer's from the last, then those
        # before it (the embedding, which a tied head's gradient also reaches)
        groups = bucket_groups(graph)
        first_layer = 1 if groups["after"] else 0
        if groups["after"]:
            backward_tail.append("ready(0)")
        if groups["block"]:
            backward_block.append(f"ready({first_layer} + N_LAYERS - 1 - l)")
        if groups["before"]:
            backward_head.append(f"ready({first_layer} + {'N_LAYERS' if groups['block'] else 0})")
    return layout, Statements(
        forward_head=forward_lines(graph, graph.head, train, "train"),
        forward_block=forward_lines(graph, graph.block, train, "train"),
        forward_tail=forward_lines(graph, graph.tail, train, "train"),
        backward_tail=backward_tail, backward_block=backward_block, backward_head=backward_head,
        decode_head=forward_lines(graph, graph.head, decode, "decode"),
        decode_block=forward_lines(graph, graph.block, decode, "decode"),
        decode_tail=forward_lines(graph, graph.tail, decode, "decode"),
        scratch=list(dict.fromkeys(scratch)),
    )


def training_memory(graph: Graph, layout: Layout, B: int, T: int, itemsize: int) -> dict[str, int]:
    """Bytes a training step at batch (B, T) holds: parameters, their gradients, AdamW's two
    moments, the activations (per layer where the backward reads them) and the gradient buffers."""
    sizes = {"B": B, "T": T, "N": B * T}

    def count(shape: tuple) -> int:
        return math.prod(sizes.get(dim, dim) if isinstance(dim, str) else dim for dim in shape)

    activations = 0
    for storage in graph.storages.values():
        copies = {"stream": graph.n_layers + 1,
                  "block": graph.n_layers if storage.name in layout.saved else 1}.get(storage.scope, 1)
        activations += count(storage.shape) * copies * (8 if storage.dtype == "int64" else itemsize)
    gradients = sum(count(graph.storages[home].shape) for home in layout.grad_storages())
    if "stream" in graph.storages:
        gradients += count(graph.storages["stream"].shape)
    params = graph.param_count() * itemsize
    return {"parameters": params, "gradients": params, "AdamW state": 2 * params,
            "activations": activations + gradients * itemsize}
