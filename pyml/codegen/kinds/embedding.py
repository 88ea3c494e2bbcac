"""embedding: row `ids[n]` of the table for each token n, times the spec's scale; its adjoint
scatter-adds the output gradient into the table's gradient (Lean law embedding_adjoint)."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Grad, Statement, WeightGrad
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, inputs, outputs, params


class Embedding(Kind):
    name = "embedding"
    laws = ("embedding_adjoint",)
    backward_reads = ("inputs",)

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        scale = {"scale": context["scale"]}
        return {"forward": ("embedding_forward", scale), "backward": ("embedding_backward", scale)}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        if env.mode == "step" and env.target == "cpu":
            # the CPU step reads the table's rows as stored (quantized or float), as its linear
            # maps do; the scale is given rounded to the step's dtype, as `embedding_forward`
            # (in Python) rounds it to the table's
            return env.stored_embedding(op, env.graph.kernel_context(op.prefix)["scale"])
        return [self.call(op, env, "forward", *inputs(op), *params(op), *outputs(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        attr = op.params["weight"]
        if not env.trainable(attr):
            return []  # a frozen embedding: its gradient is nobody's
        first = env.param_mode(attr) == "write"
        grad = WeightGrad(attr)
        return ([Call("dev.zero", (grad,))] if first else []) + [
            self.call(op, env, "backward", Act(op.inputs[0]), Grad(op.outputs[0]), grad)]


KIND = Embedding()
