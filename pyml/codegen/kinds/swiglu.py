"""swiglu: y = silu(gate) ⊙ up from the rows [gate | up] of the fused projection: the gate acts on
up as an element-wise gain (Lean law hadamard_adjoint)."""

from pyml.codegen.kinds.base import ElementWise


class SwiGLU(ElementWise):
    name = "swiglu"


KIND = SwiGLU()
