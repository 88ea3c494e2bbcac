"""silu: y = x · sigmoid(x); its slope at the saved input is the element-wise gain of its adjoint."""

from pyml.codegen.kinds.base import ElementWise


class SiLU(ElementWise):
    name = "silu"


KIND = SiLU()
