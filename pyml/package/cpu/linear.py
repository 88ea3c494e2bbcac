"""linear: y = x @ w.T (+ b), and its adjoint.

The products go through numpy's OpenBLAS: np.matmul on a transposed view passes the transpose to
BLAS as a flag, so no transposed copy is made and nothing is allocated (out=). The forward is
linear_product (pyml/package/kernels_cpu.py), which runs a product of few rows without BLAS.
"""

import numpy as np

from pyml.package.kernels_cpu import linear_product


def linear_forward(x, w, y):
    # x is (N, in), w is (out, in), y is (N, out)
    linear_product(x, w, y)


def linear_bias_forward(x, w, b, y):
    # x is (N, in), w is (out, in), b is (out,), y is (N, out)
    linear_product(x, w, y)
    y += b


def linear_backward(x, w, dy, dx, dw):
    # in the forward pass this was: y = x @ w.T
    # dx and dw are overwritten. dy is (N, out), dx like x, dw like w.
    # Lean law linear_weight_adjoint_input (linear_input_adjoint per row): dX = G W
    np.matmul(dy, w, out=dx)
    # Lean law linear_weight_adjoint_weight: dW = Gᵀ X
    np.matmul(dy.T, x, out=dw)


def linear_bias_backward(x, w, dy, dx, dw, db):
    # in the forward pass this was: y = x @ w.T + b
    # dx, dw and db are overwritten; Lean law bias_adjoint: db is the column sum of dy
    linear_backward(x, w, dy, dx, dw)
    np.sum(dy, axis=0, out=db)
