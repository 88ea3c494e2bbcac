"""embedding: row `ids[n]` of the table for each token n, times the spec's scale; its adjoint
scatter-adds the output gradient into the table's gradient (Lean law embedding_adjoint)."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Grad, Statement, StepInput, Weight, WeightGrad, kernel
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, inputs, outputs, params


class Embedding(Kind):
    name = "embedding"
    laws = ("embedding_adjoint",)
    backward_reads = ("inputs",)

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        ids, table, y = Act(op.inputs[0]), Weight(op.params["weight"]), Act(op.outputs[0])
        if env.mode == "step" and env.target == "cpu" and env.kernel_context(op.prefix)["scale"] != 1.0:
            # the CPU's `_forward` is Python: it rounds the scale to the table's dtype first
            scale = StepInput(f"{op.prefix}_scale",
                              f"p.{op.params['weight']}.dtype.type(k.{op.prefix.upper()}_SCALE)")
            return [kernel(op.prefix, "forward_kernel", ids, table, y, scale)]
        return [kernel(op.prefix, "forward", *inputs(op), *params(op), *outputs(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        attr = op.params["weight"]
        if not env.trainable(attr):
            return []  # a frozen embedding: its gradient is nobody's
        first = env.param_mode(attr) == "write"
        grad = WeightGrad(attr)
        return ([Call("dev.zero", (grad,))] if first else []) + [
            kernel(op.prefix, "backward", Act(op.inputs[0]), Grad(op.outputs[0]), grad)]


KIND = Embedding()
