"""layernorm: y = (x - mean) · rstd · w + b per row, rstd = 1 / sqrt(var(x) + eps), as
torch.nn.LayerNorm; the bias is optional. The gain is element-wise (Lean law hadamard_adjoint),
the bias is added to every row (bias_adjoint: its gradient is the column sum), the normalisation
non-linear (checked against PyTorch and finite differences). The forward saves each row's mean
and rstd for the backward."""

from __future__ import annotations

from pyml.codegen.calls import Act, Grad, Statement, Weight
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs, outputs, params


class LayerNorm(Kind):
    name = "layernorm"
    laws = ("hadamard_adjoint", "bias_adjoint")
    backward_reads = ("inputs", "aux")
    # its input usually carries on along the residual stream too, whose gradient it adds to
    adds_input_gradient = True

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        kind = "layernorm" if context["bias"] else "layernorm_unbiased"
        return {"forward": (f"{kind}_forward", {"eps": context["eps"]}),
                "backward": (f"{kind}_backward", {}), "backward_add": (f"{kind}_backward_add", {})}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [self.call(op, env, "forward", *inputs(op), *params(op), *outputs(op), *aux(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [self.call(op, env, suffix, Act(op.inputs[0]), Weight(op.params["weight"]), *aux(op),
                          Grad(op.outputs[0]), dx, *env.param_grads(op)), *after]


KIND = LayerNorm()
