"""embedding: out[n] = table[ids[n]] * scale, and its adjoint, the scatter-add.

Lean law embedding_adjoint (the gather's adjoint is the scatter-add); a scale other than 1 is a
constant element-wise gain (hadamard_adjoint), rounded to the table's dtype first, as transformers'
Gemma3TextScaledWordEmbedding rounds embed_scale.
"""

from numba import njit, prange

# the backward scatter-adds column blocks in parallel: each thread owns whole columns of dtable,
# and rows are visited in order, so the sums are deterministic
COLUMN_BLOCK = 16


@njit(cache=True, parallel=True)
def embedding_forward_kernel(ids, table, out, scale):
    # ids is (N,) int64, table is (vocab, dim), out is (N, dim); scale in table's dtype
    for n in range(ids.shape[0]):
        if ids[n] < 0 or ids[n] >= table.shape[0]:
            raise ValueError("token id out of range of the embedding table")
    for n in prange(ids.shape[0]):
        row = ids[n]
        for d in range(table.shape[1]):
            out[n, d] = table[row, d] * scale


@njit(cache=True, parallel=True)
def embedding_forward_unscaled(ids, table, out):
    # as embedding_forward_kernel with scale 1, without the multiplication
    for n in range(ids.shape[0]):
        if ids[n] < 0 or ids[n] >= table.shape[0]:
            raise ValueError("token id out of range of the embedding table")
    for n in prange(ids.shape[0]):
        row = ids[n]
        for d in range(table.shape[1]):
            out[n, d] = table[row, d]


@njit(cache=True, parallel=True)
def embedding_backward_kernel(ids, dout, dtable, scale):
    # in the forward pass this was: out[n, d] = table[ids[n], d] * scale
    # so now we have: dtable[ids[n], d] += scale * dout[n, d]. ACCUMULATES into dtable (the caller
    # zeroes it; a tied LM head adds into the same buffer). dout is (N, dim), dtable (vocab, dim).
    dim = dtable.shape[1]
    n_blocks = (dim + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    for block in prange(n_blocks):
        start = block * COLUMN_BLOCK
        stop = min(start + COLUMN_BLOCK, dim)
        for n in range(ids.shape[0]):
            row = ids[n]
            for d in range(start, stop):
                dtable[row, d] += scale * dout[n, d]


@njit(cache=True, parallel=True)
def embedding_backward_unscaled(ids, dout, dtable):
    # as embedding_backward_kernel with scale 1, without the multiplication
    dim = dtable.shape[1]
    n_blocks = (dim + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    for block in prange(n_blocks):
        start = block * COLUMN_BLOCK
        stop = min(start + COLUMN_BLOCK, dim)
        for n in range(ids.shape[0]):
            row = ids[n]
            for d in range(start, stop):
                dtable[row, d] += dout[n, d]


def embedding_forward(ids, table, out, scale):
    if scale == 1.0:
        embedding_forward_unscaled(ids, table, out)
    else:
        embedding_forward_kernel(ids, table, out, table.dtype.type(scale))


def embedding_backward(ids, dout, dtable, scale):
    if scale == 1.0:
        embedding_backward_unscaled(ids, dout, dtable)
    else:
        embedding_backward_kernel(ids, dout, dtable, dtable.dtype.type(scale))
