"""What every op kind defines, and the passes it writes itself into.

A kind (one module under `pyml/codegen/kinds/`) is the one place that knows how an op of that
kind runs: the Lean laws its adjoint implements, what its backward reads, whether its kernel can
add into an input gradient, and its statements in each pass, as `Call`s (`pyml.codegen.calls`).
The passes (`pyml.codegen.schedule`, `pyml.codegen.decode_source`) walk the graph generically and
hand each op to its kind with an environment (`ForwardEnv`, `BackwardEnv`) that knows the pass.
"""

from __future__ import annotations

from typing import Protocol

from pyml.codegen.calls import Act, Arg, Call, Code, Grad, Statement, Weight, WeightGrad, kernel
from pyml.codegen.ir import Graph, Op


class ForwardEnv(Protocol):
    """A forward pass: "train" (over B x T rows, saving what the backward reads), "decode" (one
    position per sequence, with the model's KV cache) or "step" (the fused decoding step on
    quantized weights, `target` "cpu" or "cuda")."""

    graph: Graph
    mode: str
    target: str

    def attention_index(self, op: Op) -> int: ...
    def in_parallel(self, call: Call) -> list[Statement]: ...
    def linear_row(self, op: Op) -> list[Statement]: ...
    def stored_embedding(self, op: Op, scale: float) -> list[Statement]: ...


class BackwardEnv(Protocol):
    """The reverse walk: which gradients hold a value already, and where each one lives."""

    graph: Graph

    def mode(self, value: str) -> str: ...
    def home(self, value: str) -> str: ...
    def input_gradient(self, op: Op, index: int, can_add: bool) -> tuple[Arg, list[Statement], str]: ...
    def param_grads(self, op: Op, trainable_only: bool = False) -> list[WeightGrad]: ...
    def param_mode(self, attr: str) -> str: ...
    def trainable(self, attr: str) -> bool: ...


class Kind:
    """An op kind. `laws`: the Lean laws its kernels' adjoint implements (recorded in the
    manifest by statement hash); `backward_reads`: what its adjoint reads besides the output
    gradient, its "inputs" and/or its saved statistics ("aux"), which the forward then saves per
    layer; `adds_input_gradient`: its kernel has a `_backward_add` that adds into the input
    gradient instead of writing it."""

    name = ""
    laws: tuple[str, ...] = ()
    backward_reads: tuple[str, ...] = ()
    adds_input_gradient = False
    # its kernels are rendered for each op from kinds/<name>_<target>.py.j2, specialised to the
    # op's dims, rather than shared (pyml/package/cpu, cuda) with the dims read from the arrays
    template = False

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        """{suffix: (the shared kernel, the constant arguments it takes)} for an op whose kernel
        context (dims and constants, `Graph.kernel_context`) is `context`."""
        return {}

    def call(self, op: Op, env, suffix: str, *args: Arg) -> Call:
        """The op's kernel `suffix` ("forward", "backward", ...) on `args`: its own rendered
        kernel `{prefix}_{suffix}`, or the shared one with the op's constants as keywords."""
        if self.template:
            return kernel(op.prefix, suffix, *args)
        name, constants = self.kernels(env.graph.kernel_context(op.prefix))[suffix]
        return Call(f"k.{name}", (*args, *(Code(f"{key}={value!r}") for key, value in constants.items())))

    def reads(self, op: Op) -> tuple[str, ...]:
        """What this op's adjoint reads (`backward_reads`, unless the op needs less)."""
        return self.backward_reads

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        raise NotImplementedError(f"{self.name} has no forward")

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        raise NotImplementedError(f"{self.name} has no adjoint")


def inputs(op: Op) -> list[Act]:
    return [Act(value) for value in op.inputs]


def outputs(op: Op) -> list[Act]:
    return [Act(value) for value in op.outputs]


def params(op: Op) -> list[Weight]:
    return [Weight(attr) for attr in op.params.values()]


def aux(op: Op) -> list[Act]:
    return [Act(value) for value in op.aux.values()]


class ElementWise(Kind):
    """y = f(x) (or, for a GLU, f(gate) * up) row by row, no parameter: an element-wise gain
    whose derivative at the input is read from the saved input (Lean law hadamard_adjoint)."""

    laws = ("hadamard_adjoint",)
    backward_reads = ("inputs",)

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        return {"forward": (f"{self.name}_forward", {}), "backward": (f"{self.name}_backward", {})}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [self.call(op, env, "forward", *inputs(op), *outputs(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [self.call(op, env, suffix, Act(op.inputs[0]), Grad(op.outputs[0]), dx), *after]
