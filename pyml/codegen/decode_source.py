"""The generated `decode_cpu.py`: a decoder's whole decoding step as one Numba function.

Written from the same op list as the model's `run_decode` (`pyml.codegen.lower`): each op calls the
package's own CPU kernel, as the float32 step does, except the linear ops, which call
`pyml.package.decode_cpu.linear_row` on weights in whatever format they are kept (GGUF blocks or
float32 rows). The layer loop is inside Numba, the KV cache is written in place, and every buffer
is one the caller allocated once: a token costs one call from Python. Shapes are those of one
position of one sequence (B = T = N = 1).

The step's arguments are listed once (`Argument`), so the Numba function's parameters and the
Python expressions that supply them (`step_arguments`) cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyml.codegen.ir import Graph, Op
from pyml.codegen.render import ENVIRONMENT
from pyml.codegen.schedule import graph_param


@dataclass(frozen=True)
class Argument:
    name: str  # the parameter of decode_step
    source: str  # its value in step_arguments(model, c, weights, keys, values)


def one_position(shape: tuple) -> tuple:
    return tuple(1 if isinstance(dim, str) else dim for dim in shape)


def shape_text(shape: tuple) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(map(str, shape))})"


def in_parallel(call: str) -> list[str]:
    """`call` on the pool's threads: the step runs on one thread but for the matrix-vector products
    and attention (the template says why)."""
    return ["use_pool_threads(threads)", call, "use_pool_threads(1)"]


class FusedStep:
    """Collects the step's arguments, its view definitions and its statements."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.arguments: list[Argument] = [Argument("ids", "c.ids")]
        self.views: list[str] = []
        # (op prefix, weight parameter, bias parameter or None, the weight's tensors)
        self.linears: list[tuple] = []

    def argument(self, name: str, source: str) -> str:
        if all(argument.name != name for argument in self.arguments):
            self.arguments.append(Argument(name, source))
        return name

    def value(self, name: str) -> str:
        """The expression of a value inside the step: its storage (an argument) or a view of it."""
        graph, value = self.graph, self.graph.values[name]
        storage = graph.storages[value.storage]
        if storage.scope == "stream":
            return "stream_out" if value.position == "out" else "stream_in"
        self.argument(storage.name, f"c.{storage.name}")
        if not value.view:
            return storage.name
        if name not in (line.split(" = ")[0] for line in self.views):
            shape = one_position(storage.shape)
            if value.view == "rows":
                text = f"{storage.name}.reshape({shape_text(one_position(value.shape))})"
            elif value.view == "heads":
                text = f"{storage.name}[{':, ' * (len(shape) - 2)}{value.start}:{value.stop}]"
            else:  # row_heads: B and T merged
                text = (f"{storage.name}.reshape({shape_text((1, *shape[-2:]))})"
                        f"[:, {value.start}:{value.stop}]")
            self.views.append(f"{name} = {text}")
        return name

    def param(self, attr: str) -> str:
        """A parameter: per-layer ones stacked (layers, ...) and indexed by the layer."""
        if graph_param(self.graph, attr).per_layer:
            return self.argument(attr, f"stack_layers(p.{attr})") + "[l]"
        return self.argument(attr, f"p.{attr}")

    def linear(self, op: Op, x: str, y: str) -> list[str]:
        bias = op.params.get("bias")
        self.linears.append((op.prefix, op.params["weight"], bias,
                             graph_param(self.graph, op.params["weight"]).tensors))
        weight = self.argument(f"{op.prefix}_weight", f'weights["{op.prefix}"]')
        layer = "l" if graph_param(self.graph, op.params["weight"]).per_layer else "0"
        lines = in_parallel(f"linear_row({weight}, {layer}, {x}, {y})")
        if bias is not None:
            lines.append(f"add_bias({y}, {self.param(bias)})")
        return lines

    def kernel_context(self, prefix: str) -> dict:
        return next(context for _, context in self.graph.kernel_blocks if context.get("p") == prefix)

    def lines(self, ops: list[Op]) -> list[str]:
        """The statements of `ops` (one of head, block, tail); a residual join followed by the
        RMSNorm that reads it is one fused call, as in the float32 step."""
        lines: list[str] = []
        skip = False
        for index, op in enumerate(ops):
            if skip:
                skip = False
                continue
            following = ops[index + 1] if index + 1 < len(ops) else None
            x = [self.value(v) for v in op.inputs]
            y = [self.value(v) for v in op.outputs]
            if (op.kind == "residual" and following is not None and following.kind == "rmsnorm"
                    and following.inputs[0] == op.outputs[0]):
                norm = following
                lines.append(f"k.{norm.prefix}_forward_residual({x[0]}, {x[1]}, {y[0]}, "
                             f"{self.param(norm.params['weight'])}, {self.value(norm.outputs[0])}, "
                             f"{self.value(norm.aux['rstd'])})")
                skip = True
            elif op.kind == "residual":
                lines.append(f"k.residual_add({x[0]}, {x[1]}, {y[0]})")
            elif op.kind == "embedding":
                table = self.param(op.params["weight"])
                if self.kernel_context(op.prefix)["scale"] == 1.0:
                    lines.append(f"k.{op.prefix}_forward({x[0]}, {table}, {y[0]})")
                else:  # its `_forward` is Python: it rounds the scale to the table's dtype first
                    scale = self.argument(f"{op.prefix}_scale",
                                          f"p.{op.params['weight']}.dtype.type(k.{op.prefix.upper()}_SCALE)")
                    lines.append(f"k.{op.prefix}_forward_kernel({x[0]}, {table}, {y[0]}, {scale})")
            elif op.kind in ("rmsnorm", "head_rmsnorm"):
                lines.append(f"k.{op.prefix}_forward({x[0]}, {self.param(op.params['weight'])}, "
                             f"{y[0]}, {self.value(op.aux['rstd'])})")
            elif op.kind == "linear":
                lines += self.linear(op, x[0], y[0])
            elif op.kind == "rope":
                table = op.attrs["tables"]
                cos = self.argument(f"{table.lower()}_cos", f"tuple(model.rope[t][0] for t in {table})")
                sin = self.argument(f"{table.lower()}_sin", f"tuple(model.rope[t][1] for t in {table})")
                lines.append(f"k.{op.prefix}_forward({x[0]}, {cos}[l], {sin}[l], position)")
            elif op.kind == "attention":
                index = [o for o in self.graph.block if o.kind == "attention"].index(op)
                keys = self.argument(f"{op.prefix}_keys", f"keys[{index}]")
                values = self.argument(f"{op.prefix}_values", f"values[{index}]")
                lines += [f"slot, n_valid = cache_slot({op.attrs['window']}[l], position)",
                          f"{keys}[l, :, slot] = {x[1]}[:, 0]",
                          f"{values}[l, :, slot] = {x[2]}[:, 0]",
                          *in_parallel(f"k.{op.prefix}_decode({x[0]}, {keys}[l], {values}[l], n_valid, {y[0]})")]
            elif op.kind == "loss":
                continue
            else:  # element-wise: the GLUs and the activations
                lines.append(f"k.{op.prefix}_forward({x[0]}, {y[0]})")
        return lines


def decode_context(graph: Graph) -> dict:
    step = FusedStep(graph)
    head, block, tail = step.lines(graph.head), step.lines(graph.block), step.lines(graph.tail)
    step.argument("stream_in", "c.stream_in")
    step.argument("stream_out", "c.stream_out")
    constants = sorted({op.attrs[key] for op in graph.block for key in ("tables", "window")
                        if key in op.attrs})
    return {"arguments": step.arguments, "views": step.views, "head": head, "block": block,
            "tail": tail, "linears": tuple(step.linears), "model_constants": ["N_LAYERS", *constants]}


def render_decode(graph: Graph, notice: str) -> str:
    return notice + ENVIRONMENT.get_template("package/decode_cpu.py.j2").render(**decode_context(graph))
