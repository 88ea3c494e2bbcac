"""What the rendered CUDA attention kernels (pyml/codegen/kinds/attention_cuda.py.j2) call that
does not depend on the spec's dims."""

from numba import cuda


@cuda.jit(device=True)
def window_start(t, window):
    # the first position that position t attends to: window 0 is global causal attention
    return max(t - window + 1, 0) if window > 0 else 0
