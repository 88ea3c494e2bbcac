"""head_rmsnorm: QK-norm, the RMSNorm of each q or k head over head_dim (Gemma 3, Qwen3), with
its gain shared by the heads (Lean law hadamard_adjoint)."""

from __future__ import annotations

from pyml.codegen.calls import Act, Grad, Statement, Weight
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs, outputs, params


class HeadRMSNorm(Kind):
    name = "head_rmsnorm"
    laws = ("hadamard_adjoint",)
    backward_reads = ("inputs", "aux")

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        offset = {"unit_offset": context["unit_offset"]}
        return {"forward": ("head_rmsnorm_forward", {"eps": context["eps"], **offset}),
                "backward": ("head_rmsnorm_backward", offset)}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [self.call(op, env, "forward", *inputs(op), *params(op), *outputs(op), *aux(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [self.call(op, env, suffix, Act(op.inputs[0]), Weight(op.params["weight"]), *aux(op),
                          Grad(op.outputs[0]), dx, *env.param_grads(op)), *after]


KIND = HeadRMSNorm()
