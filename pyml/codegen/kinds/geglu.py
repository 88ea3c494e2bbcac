"""geglu: y = gelu_tanh(gate) ⊙ up from the rows [gate | up] of the fused projection (Gemma's
MLP): the gate acts on up as an element-wise gain (Lean law hadamard_adjoint)."""

from pyml.codegen.kinds.base import ElementWise


class GeGLU(ElementWise):
    name = "geglu"


KIND = GeGLU()
