"""The fitting the K-quant quantizers (q4_k, q5_k, q6_k) share: llama.cpp's reference quantisers,
step for step.

A K-quant block holds 256 values in sub-blocks (8 of 32 for Q4_K and Q5_K, 16 of 16 for Q6_K).
llama.cpp (ggml-quants.c, `quantize_row_q{4,5,6}_K_ref`, which `llama-quantize` runs when no
importance matrix is given) first fits each sub-block on its own: Q6_K a symmetric scale
(`make_qx_quants`: the scale that maps the value of largest magnitude to -32, then the best of 18
nearby ones by weighted least squares), Q4_K and Q5_K a scale and a minimum (`make_qkx2_quants`: 21
or 16 trial scales around (max - min) / nmax, each refitted by weighted least squares, the one
with the smallest weighted squared error kept). Then the sub-blocks' scales (and minimums) are
themselves quantised, to 6 bits (Q4_K, Q5_K) or int8 (Q6_K) times a float16 per block, and every
value is quantised again with the scale it will be decoded with.

The fits are loops with float32 sums in a fixed order, so they are compiled (Numba) in that order,
with float32 throughout (ints made float32 before they meet a float, as C converts them): the
bytes are llama.cpp's (tests/formats/test_kquants.py compares them where llama.cpp is installed).
The float16 roundings and the packing are numpy. `nearest_int` is llama.cpp's: round to the
nearest integer, ties to even (its magic-number trick is exactly that below 2**22).
"""

import numpy as np
from numba import njit, prange

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # below this largest magnitude a sub-block counts as zeros


@njit(cache=True)
def _nearest_int(value):
    return np.int32(np.rint(value))


@njit(cache=True)
def _qx_fit(x, nmax, levels):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL): the sub-block's scale; `levels` gets
    l + nmax, l in [-nmax, nmax - 1], weights x**2."""
    n = x.shape[0]
    largest, amax = F32(0), F32(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax, largest = ax, x[i]
    if amax < GROUP_MAX_EPS:
        levels[:] = 0
        return F32(0)
    fnmax = F32(nmax)
    iscale = -fnmax / largest
    sumlx, suml2 = F32(0), F32(0)
    for i in range(n):
        l = min(max(_nearest_int(iscale * x[i]), -nmax), nmax - 1)
        levels[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    scale = sumlx / suml2 if suml2 != 0 else F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + F32(0.1) * F32(step)) / largest
        sumlx, suml2 = F32(0), F32(0)
        for i in range(n):
            l = min(max(_nearest_int(iscale * x[i]), -nmax), nmax - 1)
            w = x[i] * x[i]
            sumlx += w * x[i] * F32(l)
            suml2 += w * F32(l) * F32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                levels[i] = min(max(_nearest_int(iscale * x[i]), -nmax), nmax - 1) + nmax
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _qkx2_fit(x, nmax, rmin, rdelta, nstep, levels, trial):
    """make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false), with
    the weights of quantize_row_q{4,5}_K_ref (the sub-block's rms plus |x|): (scale, -minimum)."""
    n = x.shape[0]
    sum_x2 = F32(0)
    for i in range(n):
        sum_x2 += x[i] * x[i]
    av_x = np.sqrt(sum_x2 / F32(n))
    weights = np.empty(n, np.float32)
    for i in range(n):
        weights[i] = av_x + abs(x[i])
    low, high = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        low = min(low, x[i])
        high = max(high, x[i])
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if low > 0:
        low = F32(0)
    if high == low:
        levels[:] = 0
        return F32(0), -low
    fnmax = F32(nmax)
    iscale = fnmax / (high - low)
    scale = F32(1) / iscale
    best_error = F32(0)
    for i in range(n):
        levels[i] = min(max(_nearest_int(iscale * (x[i] - low)), 0), nmax)
        diff = scale * F32(levels[i]) + low - x[i]
        best_error += weights[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (high - low)
        sum_l, sum_l2, sum_xl = F32(0), F32(0), F32(0)
        for i in range(n):
            l = min(max(_nearest_int(iscale * (x[i] - low)), 0), nmax)
            trial[i] = l
            wl = weights[i] * F32(l)
            sum_l += wl
            sum_l2 += wl * F32(l)
            sum_xl += wl * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min = F32(0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0)
            for i in range(n):
                diff = this_scale * F32(trial[i]) + this_min - x[i]
                cur_error += weights[i] * (diff * diff)
            if cur_error < best_error:
                levels[:] = trial
                best_error, scale, low = cur_error, this_scale, this_min
    return scale, -low


@njit(cache=True, parallel=True)
def _fit_qkx2(sub_blocks, nmax, rmin, rdelta, nstep):
    """Every 32-value sub-block's (scale, minimum) and levels, by `_qkx2_fit`."""
    count = sub_blocks.shape[0]
    scales, mins = np.empty(count, np.float32), np.empty(count, np.float32)
    levels = np.empty(sub_blocks.shape, np.uint8)
    for b in prange(count):
        trial = np.empty(sub_blocks.shape[1], np.uint8)
        scales[b], mins[b] = _qkx2_fit(sub_blocks[b], nmax, rmin, rdelta, nstep, levels[b], trial)
    return scales, mins, levels


@njit(cache=True, parallel=True)
def fit_qx(sub_blocks, nmax):
    """Every 16-value sub-block's symmetric scale and levels, by `_qx_fit`."""
    count = sub_blocks.shape[0]
    scales = np.empty(count, np.float32)
    levels = np.empty(sub_blocks.shape, np.int8)
    for b in prange(count):
        scales[b] = _qx_fit(sub_blocks[b], nmax, levels[b])
    return scales, levels


def rint(values: np.ndarray) -> np.ndarray:
    return np.rint(values).astype(np.int32)


def to_half(values: np.ndarray) -> np.ndarray:
    """float32 rounded to float16 (to nearest, ties to even, as GGML_FP32_TO_FP16), as float32."""
    return values.astype(np.float16).astype(np.float32)


def _requantize(blocks, step, offset, levels, nmax):
    """The levels with the decoding step and offset (blocks, sub-blocks, 1): nearest_int((x +
    offset) / step) clamped to [0, nmax]; a sub-block whose step is 0 keeps the fit's levels."""
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(rint((blocks + offset) / step), 0, nmax)
    return np.where(step != 0, again, levels)


def k_scales(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The sub-block fits of Q4_K (nmax 15) or Q5_K (31), their 6-bit scales and mins packed as
    the format keeps them, d and dmin, and every value's level (blocks, 8, 32)."""
    sub_blocks = blocks.reshape(-1, 32)
    scales, mins, levels = _fit_qkx2(sub_blocks, nmax, F32(rmin), F32(rdelta), nstep)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale = np.maximum(scales.max(axis=1), 0)[:, None]
    max_min = np.maximum(mins.max(axis=1), 0)[:, None]
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # uint8 of the nearest int (a negative one wraps, as in C), then at most 63
    ls = np.minimum(rint(inv_scale * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(rint(inv_min * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.zeros((len(blocks), 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d, dmin = to_half(max_scale / F32(63)), to_half(max_min / F32(63))
    step = (d * ls.astype(np.float32))[:, :, None]
    offset = (dmin * lm.astype(np.float32))[:, :, None]
    levels = _requantize(blocks.reshape(-1, 8, 32), step, offset, levels.reshape(-1, 8, 32), nmax)
    halves = np.concatenate([d, dmin], axis=1).astype(np.float16).view(np.uint8)
    return halves, packed, levels.astype(np.uint8).reshape(-1, 256)
