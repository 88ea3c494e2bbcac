"""attention: causal (optionally sliding-window) softmax attention of q over k and v heads,
grouped-query; scores = scale · Q Kᵀ and out = P V are matrix products (Lean laws
matmul_adjoint_left and matmul_adjoint_right, the scale smul_adjoint), the softmax non-linear.
Decoding appends the new position's k and v to the layer's cache and attends over it."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Code, Grad, Statement, StepInput, kernel
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs


class Attention(Kind):
    name = "attention"
    laws = ("matmul_adjoint_left", "matmul_adjoint_right")
    backward_reads = ("inputs", "aux")

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        q, k, v = inputs(op)
        y = Act(op.outputs[0])
        window = Code(f"{op.attrs['window']}[l]")
        if env.mode == "train":
            return [kernel(op.prefix, "forward", q, k, v, *aux(op), y, window)]
        index = env.attention_index(op)
        if env.mode == "decode":
            return [Call("c.append", (Code(str(index)), Code("l"), Code("position"), k, v),
                         ("kc", "vc", "n_valid")),
                    kernel(op.prefix, "decode", q, Code("kc"), Code("vc"), Code("n_valid"), y)]
        keys = StepInput(f"{op.prefix}_keys", f"keys[{index}]", "[l]")
        values = StepInput(f"{op.prefix}_values", f"values[{index}]", "[l]")
        return [Call("cache_slot", (window, Code("position")), ("slot", "n_valid")),
                Call("store_slot", (keys, Code("slot"), k)),
                Call("store_slot", (values, Code("slot"), v)),
                *env.in_parallel(kernel(op.prefix, "decode", q, keys, values, Code("n_valid"), y))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dq, dk, dv = (env.input_gradient(op, index, False) for index in range(3))
        return [kernel(op.prefix, "backward", *inputs(op), *aux(op), Grad(op.outputs[0]),
                       dq[0], dk[0], dv[0], Code(f"{op.attrs['window']}[l]")),
                *dq[1], *dk[1], *dv[1]]


KIND = Attention()
