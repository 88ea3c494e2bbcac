"""embedding (CUDA): out[n] = table[ids[n]] * scale and its scatter-add adjoint (Lean law
embedding_adjoint; a scale other than 1, rounded to the table's dtype, hadamard_adjoint). The
caller checks the ids' range."""

from numba import cuda


@cuda.jit
def forward_kernel(ids, table, out, scale):
    n, d = cuda.grid(2)
    if n < out.shape[0] and d < out.shape[1]:
        out[n, d] = table[ids[n], d] * scale


@cuda.jit
def forward_unscaled_kernel(ids, table, out):
    n, d = cuda.grid(2)
    if n < out.shape[0] and d < out.shape[1]:
        out[n, d] = table[ids[n], d]


@cuda.jit
def backward_kernel(ids, dout, dtable, scale):
    # one thread per column of dtable, rows visited in order: deterministic, no atomics
    d = cuda.grid(1)
    if d < dtable.shape[1]:
        for n in range(ids.shape[0]):
            dtable[ids[n], d] += scale * dout[n, d]


@cuda.jit
def backward_unscaled_kernel(ids, dout, dtable):
    d = cuda.grid(1)
    if d < dtable.shape[1]:
        for n in range(ids.shape[0]):
            dtable[ids[n], d] += dout[n, d]


def embedding_forward(ids, table, out, scale):
    # ids is (N,) int64, table is (vocab, dim), out is (N, dim)
    blocks = ((out.shape[0] + 15) // 16, (out.shape[1] + 15) // 16)
    if scale == 1.0:
        forward_unscaled_kernel[blocks, (16, 16)](ids, table, out)
    else:
        forward_kernel[blocks, (16, 16)](ids, table, out, table.dtype.type(scale))


def embedding_backward(ids, dout, dtable, scale):
    # dtable[ids[n], d] += scale * dout[n, d]. ACCUMULATES into dtable (the caller zeroes it).
    blocks = (dtable.shape[1] + 127) // 128
    if scale == 1.0:
        backward_unscaled_kernel[blocks, 128](ids, dout, dtable)
    else:
        backward_kernel[blocks, 128](ids, dout, dtable, dtable.dtype.type(scale))
