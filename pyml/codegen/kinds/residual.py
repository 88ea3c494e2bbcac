"""residual: out = skip + body. Its adjoint is a fan-out (Lean law residual_adjoint): both inputs
get the output gradient, which they share as one buffer where the schedule lets them
(`pyml.codegen.schedule.plan_layout`); otherwise it is copied, or added where the input's
gradient already holds another contribution."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Grad, Statement
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, inputs


class Residual(Kind):
    name = "residual"

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [Call("k.residual_add", (*inputs(op), Act(op.outputs[0])))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dy = Grad(op.outputs[0])
        statements = []
        for name in op.inputs:
            if env.mode(name) == "add":
                statements.append(Call("k.add_into", (Grad(name), dy)))
            elif env.home(name) != env.home(op.outputs[0]):
                statements.append(Call("k.copy_into", (Grad(name), dy)))
        return statements


KIND = Residual()
