"""linear: y = x Wᵀ (+ b) over rows; fused projections (q/k/v, gate/up) are one op whose weight
stacks their rows, so one product computes them and its adjoint sums their input gradients."""

from __future__ import annotations

from pyml.codegen.calls import Act, Grad, Statement, Weight
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, inputs, outputs, params


class Linear(Kind):
    name = "linear"
    laws = ("linear_input_adjoint", "linear_weight_adjoint_input", "linear_weight_adjoint_weight")
    backward_reads = ("inputs",)

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        kind = "linear_bias" if context["bias"] else "linear"
        return {"forward": (f"{kind}_forward", {}), "backward": (f"{kind}_backward", {})}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        if env.mode == "step":  # the fused step's linear maps run on weights kept quantized
            return env.linear_row(op)
        return [self.call(op, env, "forward", *inputs(op), *params(op), *outputs(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [self.call(op, env, suffix, Act(op.inputs[0]), Weight(op.params["weight"]),
                          Grad(op.outputs[0]), dx, *env.param_grads(op)), *after]


KIND = Linear()
