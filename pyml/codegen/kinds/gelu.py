"""gelu: the tanh-approximated GELU; its slope at the saved input is the element-wise gain of its
adjoint."""

from pyml.codegen.kinds.base import ElementWise


class GELU(ElementWise):
    name = "gelu"


KIND = GELU()
