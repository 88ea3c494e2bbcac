"""frozen_linear: a LoRA model's linear map, y = x Wᵀ + (alpha / r) (x Aᵀ) Bᵀ per adapted row
block, with W frozen: its gradient is nobody's, the adapters' are (the laws of each adapter are in
the op's instances)."""

from __future__ import annotations

from pyml.codegen.calls import Act, Grad, Statement, kernel
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs, outputs, params


class FrozenLinear(Kind):
    name = "frozen_linear"
    laws = ("linear_input_adjoint", "linear_weight_adjoint_input")
    backward_reads = ("inputs", "aux")
    template = True  # one argument per adapter, each with its own rows

    def reads(self, op: Op) -> tuple[str, ...]:
        # the adjoint reads its input and the adapters' hidden rows only for the adapters' gradients
        return self.backward_reads if op.attrs["adapters"] else ()

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return [kernel(op.prefix, "forward", *inputs(op), *params(op), *outputs(op), *aux(op))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dx, after, suffix = env.input_gradient(op, 0, self.adds_input_gradient)
        return [kernel(op.prefix, suffix, Act(op.inputs[0]), *params(op), *aux(op),
                       Grad(op.outputs[0]), dx, *env.param_grads(op, trainable_only=True)), *after]


KIND = FrozenLinear()
