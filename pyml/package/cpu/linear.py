"""linear: y = x @ w.T (+ b), and its adjoint.

The products go through numpy's OpenBLAS: np.matmul on a transposed view passes the transpose to
BLAS as a flag, so no transposed copy is made and nothing is allocated (out=). The forward is
linear_product (pyml/package/kernels_cpu.py), which runs a product of few rows without BLAS.
"""

import numpy as np

from pyml.package.bf16_products import bf16_product
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
    # dx, dw and db are overwritten
    linear_backward(x, w, dy, dx, dw)
    bias_backward(dy, db)


def bias_backward(dy, db):
    # Lean law bias_adjoint: db is the column sum of dy
    np.sum(dy, axis=0, out=db)


# bf16 (`pyml train --precision bf16`, base.Bf16Kernels): the same maps with every product's
# operands rounded to bfloat16 and the sums in float32 (pyml/package/bf16_products.py); the bias
# and its gradient stay float32, as under torch's CPU autocast


def linear_forward_bf16(x, w, y):
    # x is (N, in), w is (out, in), y is (N, out)
    product_into(x, False, w, False, y)


def linear_bias_forward_bf16(x, w, b, y):
    product_into(x, False, w, False, y)
    y += b


def linear_backward_bf16(x, w, dy, dx, dw):
    # Lean law linear_weight_adjoint_input: dX = G W; linear_weight_adjoint_weight: dW = Gᵀ X
    product_into(dy, False, w, True, dx)
    product_into(dy, True, x, True, dw)


def linear_bias_backward_bf16(x, w, dy, dx, dw, db):
    linear_backward_bf16(x, w, dy, dx, dw)
    bias_backward(dy, db)


def product_into(a, a_across, b, b_across, c, add=False):
    # bf16_product on contiguous operands (it reads them as bits), into c or through a copy
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if c.flags.c_contiguous:
        bf16_product(a, a_across, b, b_across, c, add)
    else:
        whole = np.ascontiguousarray(c) if add else np.empty(c.shape, c.dtype)
        bf16_product(a, a_across, b, b_across, whole, add)
        c[...] = whole
