"""Q6_K: blocks of 256 values in 210 bytes, 16 sub-blocks of 16: two halves of 128 values (128
bytes of low nibbles, 64 of 2-bit highs, one half's after the other's), 16 int8 scales, float16 d.
In half h: low nibbles of bytes 64 h + i are values i (i < 64), high nibbles values 64 + i; bits
2k, 2k + 1 of byte 128 + 32 h + i are value 32 k + i's top two; value = (d * scale) * (q - 32).

The quantizer is llama.cpp's quantize_row_q6_K_ref (k_fitting.py)."""

import numpy as np

from pyml.weight_formats import k_fitting, numpy_blocks as nb, vector_ir as vir
from pyml.weight_formats.traits import GGMLType, WeightFormat

F32 = np.float32


def dequantize(blocks: np.ndarray) -> np.ndarray:
    low = nb.unpack(blocks[:, :128], 64, 4)
    high = nb.unpack(blocks[:, 128:192], 32, 2)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = nb.per_sub_block(blocks, 208, blocks[:, 192:208].view(np.int8))
    return scale * nb.sub_blocks(q, 16)


def quantize(blocks: np.ndarray) -> np.ndarray:
    """128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales and the float16 d; a
    block under GROUP_MAX_EPS is all zero bytes."""
    scales, levels = k_fitting.fit_qx(blocks.reshape(-1, 16), 32)
    scales, levels = scales.reshape(-1, 16), levels.reshape(-1, 16, 16)
    index = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, index, axis=1)
    zero = np.abs(max_scale) < k_fitting.GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_scale)
        d = k_fitting.to_half(np.where(zero, F32(0), F32(1) / iscale))
    sc = np.minimum(127, k_fitting.rint(iscale * scales)).astype(np.int8)
    step = (d * sc.astype(np.float32))[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(k_fitting.rint(blocks.reshape(-1, 16, 16) / step), -32, 31) + 32
    levels = np.where(step != 0, again, levels).astype(np.uint8).reshape(-1, 2, 4, 32)
    levels[zero[:, 0]] = 0
    sc[zero[:, 0]] = 0
    low = levels & 0xF  # (n, half, quarter, 32): value 128 h + 32 q + l
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                        axis=2).reshape(-1, 128)
    top = (levels >> 4).astype(np.uint8)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8)], axis=1)


def row_values(builder, row, values, use):
    # one block per iteration, its two halves unrolled: every byte at a constant offset in the block
    with vir.block_loop(builder, values, 256, 210, row) as (block, start):
        # d * scale of the block's 16 scales, in vector lanes (as Q4_K's)
        scales = builder.fmul(vir.splat(builder, vir.half_at(builder, block, 208), 16),
                              builder.sitofp(vir.load(builder, block, vir.index(192), vir.I8, 16),
                                             vir.vector_type(vir.F32, 16)))
        for part in range(2):
            low = vir.load(builder, block, vir.index(64 * part), vir.I8, 64)
            high = vir.load(builder, block, vir.index(128 + 32 * part), vir.I8, 32)
            for k in range(4):  # values 32k .. 32k + 31 of the half
                source = vir.lanes(builder, low, 32 * (k % 2), 32)
                nibble = (builder.and_(source, vir.byte_vector(15, 32)) if k < 2
                          else builder.lshr(source, vir.byte_vector(4, 32)))
                high_bits = builder.and_(builder.lshr(high, vir.byte_vector(2 * k, 32)), vir.byte_vector(3, 32))
                q = builder.sub(builder.or_(nibble, builder.shl(high_bits, vir.byte_vector(4, 32))),
                                vir.byte_vector(32, 32))
                q = builder.sitofp(q, vir.vector_type(vir.F32, 32))
                for half in range(2):  # 16 values per scale
                    scale = vir.lane_splat(builder, scales, 8 * part + 2 * k + half, 16)
                    use(builder.fmul(vir.lanes(builder, q, 16 * half, 16), scale),
                        builder.add(start, vir.index(128 * part + 32 * k + 16 * half)))


def cuda_arrays(blocks):
    """low uint8 (in/2), high uint8 (in/4), scale = d * sc (in/16): weight = (q - 32) * scale."""
    flat = blocks.reshape(-1, 210)
    scale = nb.per_sub_block(flat, 208, flat[:, 192:208].view(np.int8)).reshape(blocks.shape[0], -1)
    return nb.cuda_bytes(blocks, 0, 128), nb.cuda_bytes(blocks, 128, 192), np.ascontiguousarray(scale)


FORMAT = WeightFormat(GGMLType.Q6_K, 256, 210, dequantize, quantize, row_values, cuda_arrays=cuda_arrays)
