"""What the rendered attention kernels (pyml/codegen/kinds/attention_cpu.py.j2) call that does not
depend on the spec's dims."""

from numba import njit


@njit(cache=True)
def window_start(t, window):
    # the first position that position t attends to: window 0 is global causal attention
    return max(t - window + 1, 0) if window > 0 else 0


@njit(cache=True)
def clear_outside_window(row, start, t):
    # row[j] = 0 for j < start and j > t: the entries outside row t's window, which the blocks of 4
    # may have computed and the weighted sums read as weights
    for j in range(start):
        row[j] = 0.0
    for j in range(t + 1, row.shape[0]):
        row[j] = 0.0
