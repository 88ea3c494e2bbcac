"""relu: y = max(x, 0); its slope at the saved input is the element-wise gain of its adjoint."""

from pyml.codegen.kinds.base import ElementWise


class ReLU(ElementWise):
    name = "relu"


KIND = ReLU()
