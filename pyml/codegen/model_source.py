"""The generated `model.py`: the graph's parameter layout, tensor names, buffers and passes.

Everything here is derived from the graph and its schedule; the template
(`templates/model.py.j2`) only arranges it around `pyml.package.base`.
"""

from __future__ import annotations

import math

from pyml.codegen.calls import Act, Grad, Scratch, WeightGrad
from pyml.codegen.ir import Graph, Param, Value
from pyml.codegen.render import ENVIRONMENT
from pyml.codegen.schedule import Layout, Statements, Writer, graph_param
from pyml.spec.models import DecoderModel


class Name(str):
    """A constant's value written as the name of another constant."""

    def __repr__(self) -> str:
        return str(self)


def constant_text(value) -> str:
    """`value` as Python text; a per-layer table that repeats one pattern as the pattern times its
    count, `(0,) * 30` rather than thirty lines of zeros."""
    if isinstance(value, tuple) and len(value) > 1 and all(isinstance(v, (int, float)) for v in value):
        for period in range(1, len(value) // 2 + 1):
            if len(value) % period == 0 and value == value[:period] * (len(value) // period):
                return f"{value[:period]!r} * {len(value) // period}"
    if isinstance(value, list):
        return "[" + ", ".join(constant_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {constant_text(item)}" for key, item in value.items()) + "}"
    return repr(value)


def shape_text(shape: tuple, lead: tuple = ()) -> str:
    parts = [str(dim) for dim in (*lead, *shape)]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def view_text(value: Value, storage_expr: str, storage_shape: tuple, lead: tuple) -> str:
    """The expression of `value` as a view of the array `storage_expr` (whose own shape is
    `lead + storage_shape`)."""
    if value.view == "rows":
        return f"{storage_expr}.reshape({shape_text(value.shape, lead)})"
    if value.view == "heads":
        return f"heads({storage_expr}, {value.start}, {value.stop})"
    if value.view == "row_heads":
        merged = shape_text(("N", *storage_shape[-2:]), lead)
        return f"heads({storage_expr}.reshape({merged}), {value.start}, {value.stop})"
    return storage_expr


class ParameterLayout:
    """Offsets in the flat buffer: the model's parameters before the block, then each layer's
    parameters contiguously, then the model's parameters after the block."""

    def __init__(self, params: list[Param], n_layers: int, buffer: str = "flat"):
        first = next((i for i, p in enumerate(params) if p.per_layer), len(params))
        self.before = params[:first]
        self.block = [p for p in params if p.per_layer]
        self.after = [p for p in params[first:] if not p.per_layer]
        self.buffer = buffer
        self.n_layers = n_layers
        self.start: dict[str, int] = {}
        offset = 0
        for param in self.before:
            self.start[param.attr], offset = offset, offset + math.prod(param.shape)
        self.layer_start, inner = offset, 0
        for param in self.block:
            self.start[param.attr], inner = offset + inner, inner + math.prod(param.shape)
        self.layer_stride = inner
        offset += inner * n_layers
        self.after_start = offset
        for param in self.after:
            self.start[param.attr], offset = offset, offset + math.prod(param.shape)
        self.size = offset

    def view_lines(self) -> list[str]:
        lines = []
        for param in [*self.before, *self.block, *self.after]:
            start, shape = self.start[param.attr], shape_text(param.shape)
            if self.buffer == "maps":  # a float buffer's views, or a StoredMaps' rows
                where = (f"{start}, {self.layer_stride}, {shape}, N_LAYERS" if param.per_layer
                         else f"{start}, {shape}")
                function = "map_views" if param.per_layer else "map_view"
                lines.append(f'self.{param.attr} = {function}(maps, "{param.attr}", {where})')
            elif param.per_layer:
                lines.append(f"self.{param.attr} = layer_views({self.buffer}, {start}, "
                             f"{self.layer_stride}, {shape}, N_LAYERS)")
            else:
                stop = start + math.prod(param.shape)
                lines.append(f"self.{param.attr} = {self.buffer}[{start}:{stop}].reshape({shape})")
        return lines

    def view_functions(self) -> list[str]:
        """The functions of pyml.package.base that a maps layout's `view_lines` call."""
        return [name for name, params in (("map_view", self.before + self.after),
                                          ("map_views", self.block)) if params]

    def description(self) -> str:
        def one(param: Param) -> str:
            return f"{param.attr}({','.join(str(d) for d in param.shape)})"

        parts = [one(p) for p in self.before]
        if self.block:
            parts.append(f"layers[{self.n_layers}]({' '.join(one(p) for p in self.block)})")
        parts += [one(p) for p in self.after]
        return " ".join(parts)

    def buckets(self, graph: Graph) -> str:
        """Gradient buckets in the order the backward finishes them (`schedule.ready_calls`), as a
        Python expression: for a decoder, the tail's parameters, each layer from the last, then
        the head's; for a sequential model, each op's parameters from the last op."""
        if graph.form == "sequential":
            sizes = {p.attr: math.prod(p.shape) for p in self.before}
            buckets = []
            for op in reversed(graph.head):
                attrs = [a for a in op.params.values() if a in sizes]
                if attrs:
                    buckets.append((min(self.start[a] for a in attrs),
                                    max(self.start[a] + sizes[a] for a in attrs)))
            return repr(buckets)
        parts = [f"[({self.after_start}, {self.size})]"] if self.after else []
        if self.block:
            start, stride = self.layer_start, self.layer_stride
            parts.append(f"[({start} + l * {stride}, {start} + (l + 1) * {stride}) "
                         "for l in reversed(range(N_LAYERS))]")
        if self.before:
            parts.append(f"[(0, {self.layer_start})]")
        return " + ".join(parts) or "[]"


def frozen_map_attrs(graph: Graph) -> set[str]:
    """The frozen parameters that are a frozen linear map's weight and nothing else's (a tied LM
    head's matrix is the embedding's table, which stays a float parameter): a LoRA model's base
    matrices, which it may read where its folder stores them."""
    weights = {op.params["weight"] for op in graph.ops() if op.kind == "frozen_linear"}
    elsewhere = {attr for op in graph.ops() if op.kind != "frozen_linear" for attr in op.params.values()}
    return {p.attr for p in graph.params if not p.trainable and p.attr in weights - elsewhere}


def tensor_lines(layout: ParameterLayout) -> list[str]:
    def entries(param: Param, index: str) -> list[str]:
        lines = []
        for name, first, last in param.tensors:
            view = f"params.{param.attr}{index}"
            if (first, last) != (0, param.shape[0]):
                view += f"[{first}:{last}]"
            key = f'f"{name}"' if "{l}" in name else f'"{name}"'
            lines.append(f'table[{key}] = ({view}, "{param.init}", {param.fan_in})')
        return lines

    lines = [line for param in layout.before for line in entries(param, "")]
    if layout.block:
        lines.append("for l in range(N_LAYERS):")
        lines += [f"    {line}" for param in layout.block for line in entries(param, "[l]")]
    lines += [line for param in layout.after for line in entries(param, "")]
    return lines


def gradient_names(graph: Graph, layout: Layout, statements: Statements) -> set[str]:
    """The attributes of `g` the backward's calls use: value gradients not kept in place, scratch
    buffers, and frozen parameters' gradients."""
    names = set()
    for arg in statements.backward_args:
        if isinstance(arg, Grad) and layout.grad_home[graph.values[arg.value].storage] != "in_place":
            names.add(arg.value)
        elif isinstance(arg, Scratch):
            names.add(f"scratch_{arg.value}")
        elif isinstance(arg, WeightGrad) and not graph_param(graph, arg.attr).trainable:
            names.add(f"frozen_{arg.attr}")
    return names


def activation_lines(graph: Graph, layout: Layout) -> list[str]:
    lines = []
    for storage in graph.storages.values():
        dtype = ", np.int64" if storage.dtype == "int64" else ""
        if storage.scope == "stream":
            lines.append("# the residual stream at each block's input, and the last output")
            lines.append(f"self.stream = zeros({shape_text(storage.shape, ('N_LAYERS + 1',))})")
            continue
        per_layer = storage.scope == "block" and storage.name in layout.saved
        lead = ("kept",) if per_layer else ()
        lines.append(f"self.{storage.name} = zeros({shape_text(storage.shape, lead)}{dtype})")
    for value in graph.values.values():
        storage = graph.storages[value.storage]
        if value.view and storage.scope != "stream":
            per_layer = storage.scope == "block" and storage.name in layout.saved
            lead = ("kept",) if per_layer else ()
            lines.append(f"self.{value.name} = "
                         f"{view_text(value, f'self.{value.storage}', storage.shape, lead)}")
    lines.append("self.targets = zeros(N, np.int64)")
    lines.append("# None: the loss is the targets' mean cross-entropy; else (N,) float64 weights of each")
    lines.append("# row's cross-entropy in the gradient (DecoderModel.loss_and_grads' token_weights)")
    lines.append("self.token_weights = None")
    if graph.form == "decoder":
        lines.append("# each token's position in its example: t, or from 0 at each example packed in a row")
        lines.append("self.positions = zeros((B, T), np.int64)")
    return lines + logits_alias(graph)


def gradient_lines(graph: Graph, layout: Layout, statements: Statements) -> list[str]:
    used = gradient_names(graph, layout, statements)
    lines = []
    if any(s.scope == "stream" for s in graph.storages.values()):
        lines.append(f"self.stream = zeros({shape_text(graph.storages['stream'].shape)})"
                     "  # the residual stream's gradient, carried from layer to layer")
    homes = layout.grad_storages()
    for name in homes:
        if name in used or any(layout.grad_home.get(graph.values[v].storage) == name
                               for v in used if v in graph.values):
            lines.append(f"self.{name} = zeros({shape_text(graph.storages[name].shape)})")
    for name in sorted(used):
        if name.startswith(("scratch_", "frozen_")) or name in homes or name == "stream":
            continue
        value = graph.values[name]
        home = layout.grad_home[value.storage]
        storage = graph.storages[value.storage]
        note = "  # a residual join passes its gradient through" if (
            home != value.storage and not value.view) else ""
        lines.append(f"self.{name} = {view_text(value, f'self.{home}', storage.shape, ())}{note}")
    for name in statements.scratch:
        lines.append(f"self.scratch_{name} = zeros({shape_text(graph.values[name].shape)})"
                     "  # where an adjoint writes before its result is added")
    for param in graph.params:
        if f"frozen_{param.attr}" in used:
            lines.append(f"self.frozen_{param.attr} = zeros({shape_text(param.shape)})"
                         "  # a frozen gain's gradient, computed by its kernel and never used")
    return lines


def decode_lines(graph: Graph, statements: Statements) -> list[str]:
    # the values the decoding step's calls read or write (the stream's two buffers are always there)
    used = {arg.value for arg in statements.decode_args if isinstance(arg, Act)
            and graph.storages[graph.values[arg.value].storage].scope != "stream"}
    needed = {graph.values[name].storage for name in used if name in graph.values}
    lines = []
    for storage in graph.storages.values():
        if storage.scope == "stream":
            shape = shape_text(storage.shape)
            lines.append(f"self.stream_in, self.stream_out = zeros({shape}), zeros({shape})")
        elif storage.name in needed:
            dtype = ", np.int64" if storage.dtype == "int64" else ""
            lines.append(f"self.{storage.name} = zeros({shape_text(storage.shape)}{dtype})")
    for name in sorted(used):
        value = graph.values.get(name)
        if value is not None and value.view and graph.storages[value.storage].scope != "stream":
            storage = graph.storages[value.storage]
            lines.append(f"self.{name} = {view_text(value, f'self.{value.storage}', storage.shape, ())}")
    return lines + logits_alias(graph)


def logits_alias(graph: Graph) -> list[str]:
    storage = graph.values[graph.logits].storage
    return [] if storage == "logits" else [f"self.logits = self.{storage}"]


def model_context(spec, spec_path: str, graph: Graph, layout: Layout, statements: Statements) -> dict:
    params = ParameterLayout([p for p in graph.params if p.trainable], graph.n_layers)
    map_attrs = frozen_map_attrs(graph)
    frozen = ParameterLayout([p for p in graph.params if not p.trainable and p.attr not in map_attrs],
                             graph.n_layers, "frozen")
    maps = ParameterLayout([p for p in graph.params if p.attr in map_attrs], graph.n_layers, "maps")
    maps_parts = {p.attr: tuple(p.tensors) for p in graph.params if p.attr in map_attrs}
    decoder = isinstance(spec, DecoderModel)
    constants = dict(graph.constants)
    if decoder:
        attentions = spec.attentions()
        mlps = [item for item in _all_items(spec.block_items()) if item.layer.kind == "mlp"]
        if len(attentions) == 1 and len(mlps) == 1:
            # the block's one attention and one MLP, by the names Llama-family configs use
            attention = attentions[0]
            constants |= {"N_HEADS": attention.n_heads, "N_KV_HEADS": attention.n_kv_heads,
                          "HEAD_DIM": attention.head_dim, "HIDDEN": mlps[0].layer.hidden}
        # (RoPE base, half the head_dim, its scaling or None) of each RoPE table
        constants["ROPE_TABLES"] = tuple(graph.rope_tables)
        constants["ATTENTIONS"] = [
            {"windows": Name(cache["window"]), "n_kv_heads": cache["n_kv_heads"],
             "head_dim": cache["head_dim"]} for cache in graph.attention_caches]
    # the prompt's buffers keep every layer's keys and values (`DecoderModel.start_decoding`)
    writer = Writer(graph, layout.saved, slot="l")
    fill = [f"c.fill({index}, l, {writer.activation(cache['k'])}, {writer.activation(cache['v'])}, T)"
            for index, cache in enumerate(graph.attention_caches)]
    class_constants = [name for name in constants
                       if name in ("VOCAB", "N_LAYERS", "MAX_SEQ_LEN", "ROPE_TABLES", "INPUT_DIM",
                                   "OUTPUT_DIM")]
    buckets = params.buckets(graph)
    return {
        "spec_name": spec.name, "spec_path": spec_path, "form": graph.form,
        "description": "a decoder" if decoder else "a sequential stack",
        "constants": [(name, constant_text(value)) for name, value in constants.items()],
        "buckets": buckets,
        "per_layer": bool(params.block), "param_size": params.size, "layout": params.description(),
        "param_views": params.view_lines(), "tensor_lines": tensor_lines(params),
        "frozen_size": frozen.size, "frozen_views": frozen.view_lines(),
        "frozen_tensor_lines": tensor_lines(frozen),
        "maps_size": maps.size, "maps_views": maps.view_lines(), "maps_tensor_lines": tensor_lines(maps),
        "maps_parts": constant_text(maps_parts),
        "base_imports": sorted({"AdamW", "heads", "layer_views", "train_step", *maps.view_functions()}),
        "tensors_function": "hf_tensors" if decoder else "named_tensors",
        "activation_lines": activation_lines(graph, layout),
        "gradient_lines": gradient_lines(graph, layout, statements),
        "decode_lines": decode_lines(graph, statements) if decoder else [],
        "base_class": "DecoderModel" if decoder else "SequentialModel",
        "class_constants": class_constants,
        "forward_head": statements.forward_head, "forward_block": statements.forward_block,
        "forward_tail": statements.forward_tail, "backward_tail": statements.backward_tail,
        "backward_block": statements.backward_block, "backward_head": statements.backward_head,
        "decode_head": statements.decode_head, "decode_block": statements.decode_block,
        "decode_tail": statements.decode_tail, "fill_lines": fill,
    }


def _all_items(items):
    for item in items:
        yield item
        yield from _all_items(item.body)


def render_model(spec, spec_path: str, graph: Graph, layout: Layout, statements: Statements) -> str:
    context = model_context(spec, spec_path, graph, layout, statements)
    return ENVIRONMENT.get_template("model.py.j2").render(**context)
