"""linear (CUDA): y = x @ w.T (+ b) and its adjoint, products by the tiled matmul of
pyml/package/kernels_cuda.py."""

from numba import cuda

from pyml.package.kernels_cuda import matmul


@cuda.jit
def add_bias_kernel(y, b):
    row, col = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        y[row, col] += b[col]


@cuda.jit
def bias_grad_kernel(dy, db):
    # one thread per column, rows summed in order (deterministic)
    col = cuda.grid(1)
    if col < db.shape[0]:
        acc = dy[0, col] * 0.0
        for row in range(dy.shape[0]):
            acc += dy[row, col]
        db[col] = acc


def linear_forward(x, w, y):
    matmul("nt", x, w, y)


def linear_bias_forward(x, w, b, y):
    matmul("nt", x, w, y)
    add_bias_kernel[((y.shape[0] + 15) // 16, (y.shape[1] + 15) // 16), (16, 16)](y, b)


def linear_backward(x, w, dy, dx, dw):
    # Lean law linear_weight_adjoint_input: dX = G W; linear_weight_adjoint_weight: dW = Gᵀ X
    matmul("nn", dy, w, dx)
    matmul("tn", dy, x, dw)


def linear_bias_backward(x, w, dy, dx, dw, db):
    # and Lean law bias_adjoint: db is the column sum of dy
    linear_backward(x, w, dy, dx, dw)
    bias_grad_kernel[(db.shape[0] + 127) // 128, 128](dy, db)
