"""What the rendered CUDA attention kernels (pyml/codegen/kinds/attention_cuda.py.j2) call that
does not depend on the spec's dims."""

from numba import cuda


@cuda.jit(device=True)
def row_start(positions, b, t, window):
    # the first position that token t of row b attends to, as pyml.package.cpu.attention.row_start
    start = t - positions[b, t]
    if window > 0:
        return max(t - window + 1, start)
    return start
