"""The generated `decode_cpu.py` and `decode_cuda.py`: a decoder's decoding step on weights kept
quantized, for each target.

Written from the same op list as the model's `run_decode`, each op by its kind
(`pyml.codegen.kinds`, in the pass's mode "step"): each op calls the package's own kernel, as the
float32 step does, except the linear ops, which call the target's linear map on weights in
whatever format they are kept: on the CPU `linear_stored` (pyml/package/decode_cpu.py), which reads
each row where the model's file stores it, as the embedding does (`embedding_stored`), so the step
needs no float32 copy of any large weight; on CUDA `linear_row` (decode_cuda.py) on GGUF blocks or
float32 rows copied to the device. The KV cache is written in place, and every buffer is one the
caller allocated once. On the CPU the step is one Numba function with the layer loop inside, so a
token costs one call from Python; on CUDA it is a Python function that launches one kernel per op
and never waits for the device, since a kernel cannot launch the next. Shapes are those of one
position (T = 1) of each sequence decoded: on the CPU a batch of B sequences (N = B), each at its
own position and in its own row of the caches, each computed as it would be alone, so that a
sequence's tokens do not depend on the batch it runs in (`pyml serve`), the LM head on the first
n_logits of them only; on CUDA one sequence (B = N = 1).

The step's arguments are listed once (`Argument`), so the Numba function's parameters and the
Python expressions that supply them (`step_arguments`) cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyml.codegen.calls import Act, Arg, Call, Code, Statement, StepInput, Weight
from pyml.codegen.ir import Graph, Op
from pyml.codegen.render import ENVIRONMENT
from pyml.codegen.schedule import forward_statements, graph_param, render

POOL = Call("use_pool_threads", (Code("threads"),))
ONE_THREAD = Call("use_pool_threads", (Code("1"),))


@dataclass(frozen=True)
class Argument:
    name: str  # the parameter of decode_step
    source: str  # its value in step_arguments(model, c, weights, keys, values)


def one_position(shape: tuple, target: str) -> tuple:
    """`shape` for one position of each sequence: on the CPU, whose step runs a batch of B
    sequences, B for the batch dims (B, N) and 1 for T; on CUDA, one sequence: 1 for each."""
    if target == "cpu":
        return tuple({"B": "B", "N": "B", "T": 1}.get(dim, dim) if isinstance(dim, str) else dim
                     for dim in shape)
    return tuple(1 if isinstance(dim, str) else dim for dim in shape)


def shape_text(shape: tuple) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(map(str, shape))})"


class FusedStep:
    """The step's pass (`ForwardEnv` in mode "step"): collects its arguments, its view definitions
    and the linear maps it runs, and spells each op's calls for `target`."""

    mode = "step"

    def __init__(self, graph: Graph, target: str):
        self.graph, self.target = graph, target
        # on the CPU the tail (the final norm, the LM head) runs on the first n_logits entries only:
        # a prompt's chunk needs the logits of its last position at most
        self.rows = ""
        self.arguments: list[Argument] = [Argument("ids", "c.ids")]
        self.views: list[str] = []
        # (op prefix, weight parameter, bias parameter or None, the weight's tensors)
        self.linears: list[tuple] = []
        # on the CPU: (op prefix, table parameter, the table's tensors) of each embedding op, whose
        # rows the step reads as stored; and (parameter, per layer, its tensors) of every other
        # parameter the step reads (norm gains, biases), which the caller supplies as arrays
        self.embeddings: list[tuple] = []
        self.parameters: list[tuple] = []

    def argument(self, name: str, source: str) -> str:
        if all(argument.name != name for argument in self.arguments):
            self.arguments.append(Argument(name, source))
        return name

    def value(self, name: str) -> str:
        """The expression of a value inside the step: its storage (an argument) or a view of it."""
        graph, value = self.graph, self.graph.values[name]
        storage = graph.storages[value.storage]
        if storage.scope == "stream":
            return ("stream_out" if value.position == "out" else "stream_in") + self.rows
        self.argument(storage.name, f"c.{storage.name}")
        if not value.view:
            return storage.name + self.rows
        if name not in (line.split(" = ")[0] for line in self.views):
            shape = one_position(storage.shape, self.target)
            if value.view == "rows":
                text = f"{storage.name}.reshape({shape_text(one_position(value.shape, self.target))})"
            elif value.view == "heads":
                text = f"{storage.name}[{':, ' * (len(shape) - 2)}{value.start}:{value.stop}]"
            else:  # row_heads: B and T merged
                rows = "B" if self.target == "cpu" else 1
                text = (f"{storage.name}.reshape({shape_text((rows, *shape[-2:]))})"
                        f"[:, {value.start}:{value.stop}]")
            self.views.append(f"{name} = {text}")
        return name + self.rows

    def param(self, attr: str) -> str:
        """A parameter; a per-layer one indexed by the layer: on the CPU stacked (layers, ...), on
        CUDA the model's list of views."""
        param = graph_param(self.graph, attr)
        if all(attr != known for known, _, _ in self.parameters):
            self.parameters.append((attr, param.per_layer, param.tensors))
        if param.per_layer:
            source = f"stack_layers(p.{attr})" if self.target == "cpu" else f"p.{attr}"
            return self.argument(attr, source) + "[l]"
        return self.argument(attr, f"p.{attr}")

    def spell(self, arg: Arg) -> str:
        if isinstance(arg, Act):
            return self.value(arg.value)
        if isinstance(arg, Weight):
            return self.param(arg.attr)
        if isinstance(arg, StepInput):
            return self.argument(arg.name, arg.source) + arg.index
        if isinstance(arg, Code):
            return arg.text
        raise TypeError(f"{arg!r} has no spelling in the fused step")

    def attention_index(self, op: Op) -> int:
        return [o for o in self.graph.block if o.kind == "attention"].index(op)

    def in_parallel(self, call: Call) -> list[Statement]:
        """`call`, on the CPU on the pool's threads: the step runs on one thread but for the
        matrix-vector products and attention (the template says why)."""
        if self.target == "cpu":
            return [POOL, call, ONE_THREAD]
        return [call]

    def linear_row(self, op: Op) -> list[Statement]:
        """A linear op as the target's linear map on the weights as kept, then its bias."""
        bias = op.params.get("bias")
        weight_param = graph_param(self.graph, op.params["weight"])
        self.linears.append((op.prefix, op.params["weight"], bias, weight_param.tensors))
        weight = StepInput(f"{op.prefix}_weight", f'weights["{op.prefix}"]')
        # a model-level weight (the tied head) is layer 0 as an int64, not a literal 0: a literal
        # would compile a second `linear_stored` into every step (about 17 s here)
        model_level = "np.int64(0)" if self.target == "cpu" else "0"
        layer = Code("l" if weight_param.per_layer else model_level)
        linear_map = "linear_stored" if self.target == "cpu" else "linear_row"
        statements = self.in_parallel(Call(linear_map, (weight, layer, Act(op.inputs[0]),
                                                          Act(op.outputs[0]))))
        if bias is not None:
            statements.append(Call("add_bias", (Act(op.outputs[0]), Weight(bias))))
        return statements

    def stored_embedding(self, op: Op, scale: float) -> list[Statement]:
        """An embedding op on the CPU: `embedding_stored` on its table's rows as stored, times
        `scale` in the step's dtype (1.0 leaves the rows' bits as they are)."""
        attr = op.params["weight"]
        self.embeddings.append((op.prefix, attr, graph_param(self.graph, attr).tensors))
        table = StepInput(f"{op.prefix}_weight", f'weights["{op.prefix}"]')
        rounded = StepInput(f"{op.prefix}_scale", f"c.stream_in.dtype.type({scale!r})")
        return [Call("embedding_stored", (table, Act(op.inputs[0]), Act(op.outputs[0]), rounded))]

    def lines(self, ops: list[Op]) -> list[str]:
        """The statements of `ops` (one of head, block, tail), as the model's decoding pass; two
        parallel ops in a row stay on the pool's threads."""
        statements = forward_statements(ops, self)
        kept = []
        for statement in statements:
            if kept and statement == POOL and kept[-1] == ONE_THREAD:
                kept.pop()
            else:
                kept.append(statement)
        return render(kept, self.spell)


def decode_context(graph: Graph, target: str) -> dict:
    step = FusedStep(graph, target)
    head, block = step.lines(graph.head), step.lines(graph.block)
    if target == "cpu":
        step.rows = "[:n_logits]"
    tail = step.lines(graph.tail)
    step.argument("stream_in", "c.stream_in")
    step.argument("stream_out", "c.stream_out")
    constants = sorted({op.attrs[key] for op in graph.block for key in ("tables", "window")
                        if key in op.attrs})
    return {"arguments": step.arguments, "views": step.views, "head": head, "block": block,
            "tail": tail, "linears": tuple(step.linears), "embeddings": tuple(step.embeddings),
            "parameters": tuple(step.parameters), "model_constants": ["N_LAYERS", *constants]}


def render_decode(graph: Graph, target: str, notice: str) -> str:
    return notice + ENVIRONMENT.get_template(f"decode_{target}.py.j2").render(
        **decode_context(graph, target))
