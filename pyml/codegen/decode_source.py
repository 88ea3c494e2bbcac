"""The generated `decode_cpu.py` and `decode_cuda.py`: a decoder's decoding step on weights kept
quantized, for each target.

Written from the same op list as the model's `run_decode` (`pyml.codegen.lower`): each op calls the
package's own kernel, as the float32 step does, except the linear ops, which call the target's
`linear_row` (pyml/package/decode_cpu.py, decode_cuda.py) on weights in whatever format they are
kept (GGUF blocks or float32 rows). The KV cache is written in place, and every buffer is one the
caller allocated once. On the CPU the step is one Numba function with the layer loop inside, so a
token costs one call from Python; on CUDA it is a Python function that launches one kernel per op
and never waits for the device, since a kernel cannot launch the next. Shapes are those of one
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


class FusedStep:
    """Collects the step's arguments, its view definitions and its statements for `target`."""

    def __init__(self, graph: Graph, target: str):
        self.graph, self.target = graph, target
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
        """A parameter; a per-layer one indexed by the layer: on the CPU stacked (layers, ...), on
        CUDA the model's list of views."""
        if graph_param(self.graph, attr).per_layer:
            source = f"stack_layers(p.{attr})" if self.target == "cpu" else f"p.{attr}"
            return self.argument(attr, source) + "[l]"
        return self.argument(attr, f"p.{attr}")

    def in_parallel(self, call: str) -> list[str]:
        """`call`, on the CPU on the pool's threads: the step runs on one thread but for the
        matrix-vector products and attention (the template says why)."""
        if self.target == "cpu":
            return ["use_pool_threads(threads)", call, "use_pool_threads(1)"]
        return [call]

    def linear(self, op: Op, x: str, y: str) -> list[str]:
        bias = op.params.get("bias")
        self.linears.append((op.prefix, op.params["weight"], bias,
                             graph_param(self.graph, op.params["weight"]).tensors))
        weight = self.argument(f"{op.prefix}_weight", f'weights["{op.prefix}"]')
        layer = "l" if graph_param(self.graph, op.params["weight"]).per_layer else "0"
        lines = self.in_parallel(f"linear_row({weight}, {layer}, {x}, {y})")
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
                if self.target == "cuda" or self.kernel_context(op.prefix)["scale"] == 1.0:
                    lines.append(f"k.{op.prefix}_forward({x[0]}, {table}, {y[0]})")
                else:  # the CPU's `_forward` is Python: it rounds the scale to the table's dtype first
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
                lines.append(f"slot, n_valid = cache_slot({op.attrs['window']}[l], position)")
                if self.target == "cpu":
                    lines += [f"{keys}[l, :, slot] = {x[1]}[:, 0]", f"{values}[l, :, slot] = {x[2]}[:, 0]"]
                else:  # a kernel: a slice assignment to a device array waits for the device
                    lines += [f"store_slot({keys}[l], slot, {x[1]})", f"store_slot({values}[l], slot, {x[2]})"]
                lines += self.in_parallel(f"k.{op.prefix}_decode({x[0]}, {keys}[l], {values}[l], n_valid, {y[0]})")
            elif op.kind == "loss":
                continue
            else:  # element-wise: the GLUs and the activations
                lines.append(f"k.{op.prefix}_forward({x[0]}, {y[0]})")
        return lines


def decode_context(graph: Graph, target: str) -> dict:
    step = FusedStep(graph, target)
    head, block, tail = step.lines(graph.head), step.lines(graph.block), step.lines(graph.tail)
    step.argument("stream_in", "c.stream_in")
    step.argument("stream_out", "c.stream_out")
    constants = sorted({op.attrs[key] for op in graph.block for key in ("tables", "window")
                        if key in op.attrs})
    return {"arguments": step.arguments, "views": step.views, "head": head, "block": block,
            "tail": tail, "linears": tuple(step.linears), "model_constants": ["N_LAYERS", *constants]}


def render_decode(graph: Graph, target: str, notice: str) -> str:
    return notice + ENVIRONMENT.get_template(f"package/decode_{target}.py.j2").render(
        **decode_context(graph, target))
