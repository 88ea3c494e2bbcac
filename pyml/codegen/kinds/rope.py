"""rope: the rotary position embedding of q and k heads in place, by the cos/sin table of the
op's layer type: a block rotation, whose adjoint is the transposed rotation (Lean law
rotation_adjoint), applied to the gradient in place. Each token is rotated by the table's row of
its position in its example (`s.positions`: 0, 1, ... from each example packed in a row); the
rows are data to the law, which holds for any cos and sin."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Code, Grad, Statement, StepInput
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind


def table_lookup(op: Op) -> Call:
    """cos, sin = the table of this layer's type (`self.rope_table`)."""
    return Call("self.rope_table", (Code(f"{op.attrs['tables']}[l]"),), ("cos", "sin"))


class Rope(Kind):
    name = "rope"
    laws = ("rotation_adjoint",)

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        # the tables are the model's (`DecoderModel.rope`), filled once by rope_tables
        return {"forward": ("rope_forward", {}), "decode": ("rope_decode", {}),
                "decode_rows": ("rope_decode_rows", {}), "backward": ("rope_backward", {}), "tables": ("rope_tables", {"theta": context["theta"]})}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        x = Act(op.inputs[0])
        if env.mode == "step":  # the tables of every layer type, indexed by the layer's
            table = op.attrs["tables"]
            cos = StepInput(f"{table.lower()}_cos", f"tuple(model.rope[t][0] for t in {table})", "[l]")
            sin = StepInput(f"{table.lower()}_sin", f"tuple(model.rope[t][1] for t in {table})", "[l]")
            if env.target == "cpu":  # each sequence of the batch at its own position
                return [self.call(op, env, "decode_rows", x, cos, sin, Code("positions"))]
            return [self.call(op, env, "decode", x, cos, sin, Code("position"))]
        if env.mode == "decode":
            return [table_lookup(op), self.call(op, env, "decode", x, Code("cos"), Code("sin"), Code("position"))]
        # each token at its position in its example (`s.positions`, restarting at each packed one)
        return [table_lookup(op), self.call(op, env, "forward", x, Code("cos"), Code("sin"), Code("s.positions"))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        # in place: the rotated gradient replaces the gradient of the rotation
        return [table_lookup(op),
                self.call(op, env, "backward", Grad(op.outputs[0]), Code("cos"), Code("sin"),
                          Code("s.positions"))]


KIND = Rope()
