"""What the rendered attention kernels (pyml/codegen/kinds/attention_cpu.py.j2) call that does not
depend on the spec's dims."""

from numba import njit

# The decode kernels take a whole group of query heads per job (each group's keys and values then
# come from memory once) when a step has at least this many (entry, kv head) pairs; with fewer
# (one SmolLM2 sequence has 3 groups, one Gemma 3 270M sequence 1) a job is one query head, so
# that the pool's threads of a 2-core machine all have work.
DECODE_GROUP_JOBS = 4


@njit(cache=True)
def row_start(positions, b, t, window):
    # the first position that token t of row b attends to: the start of its window (window 0 is
    # global causal attention), and never before the first token of its example. positions[b, t]
    # is t's position in its example, so a window packing several examples (`positions` restarting
    # at 0 at each) attends within each example only; one example per row has positions[b, t] = t.
    # Both bounds grow with t, so a block's first row has the smallest start of the block.
    start = t - positions[b, t]
    if window > 0:
        return max(t - window + 1, start)
    return start


@njit(cache=True)
def clear_outside_window(row, start, t):
    # row[j] = 0 for j < start and j > t: the entries outside row t's window, which the blocks of 4
    # may have computed and the weighted sums read as weights
    for j in range(start):
        row[j] = 0.0
    for j in range(t + 1, row.shape[0]):
        row[j] = 0.0
