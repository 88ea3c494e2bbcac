"""rmsnorm: y = x · rstd · g with rstd = 1 / sqrt(mean(x²) + eps) per row and the gain g = w (or
1 + w, Gemma's unit offset); the gain is element-wise (Lean law hadamard_adjoint), the
normalisation non-linear (checked against PyTorch and finite differences).

`residual_rmsnorm` is the fusion of a residual join and the norm that reads its output
(`pyml.codegen.passes.fuse_residual_norms`): one pass over the rows adds and normalises, in the
forward passes only; the backward runs the two ops' adjoints."""

from __future__ import annotations

from pyml.codegen.calls import Act, Grad, Statement, Weight
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs, outputs, params


class RMSNorm(Kind):
    name = "rmsnorm"
    laws = ("hadamard_adjoint",)
    backward_reads = ("inputs", "aux")
    # its input usually carries on along the residual stream too, whose gradient it adds to
    adds_input_gradient = True

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        offset = {"unit_offset": context["unit_offset"]}
        forward = {"eps": context["eps"], **offset}
        return {"forward": ("rmsnorm_forward", forward),
                "forward_residual": ("rmsnorm_forward_residual", forward),
                "backward": ("rmsnorm_backward", offset), "backward_add": ("rmsnorm_backward_add", offset)}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [self.call(op, env, "forward", *inputs(op), *params(op), *outputs(op), *aux(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [self.call(op, env, suffix, Act(op.inputs[0]), Weight(op.params["weight"]), *aux(op),
                          Grad(op.outputs[0]), dx, *env.param_grads(op)), *after]


class ResidualRMSNorm(Kind):
    """(skip, body) -> (skip + body, rmsnorm(skip + body)); forward only."""

    name = "residual_rmsnorm"

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [KIND.call(op, env, "forward_residual", *inputs(op), Act(op.outputs[0]),
                          *params(op), Act(op.outputs[1]), *aux(op))]


KIND = RMSNorm()
FUSED = ResidualRMSNorm()
