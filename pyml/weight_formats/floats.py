"""The plain float formats, "blocks" of one value: F32 and F16 (written by export-gguf), BF16 (read
only; bfloat16 is the top half of a float32). A row of them is read 64 values at a time, then 16,
then one by one, so a row may have any length. F64 is not a weight format of pyml's: only the
float64 models of the exact tests have such rows (pyml/package/decode_cpu.py reads them)."""

import numpy as np
from llvmlite import ir

from pyml.weight_formats import vector_ir as vir
from pyml.weight_formats.traits import GGMLType, WeightFormat


def f32_load(builder, row, start, count):
    return vir.load(builder, builder.bitcast(row, vir.F32.as_pointer()), start, vir.F32, count)


def f16_load(builder, row, start, count):
    halves = vir.load(builder, builder.bitcast(row, vir.F16.as_pointer()), start, vir.F16, count)
    return builder.fpext(halves, vir.vector_type(vir.F32, count))


def bf16_load(builder, row, start, count):
    """bfloat16 is the top half of a float32: its 16 bits shifted into place."""
    int16, int32 = ir.IntType(16), vir.vector_type(vir.I32, count)
    bits = vir.load(builder, builder.bitcast(row, int16.as_pointer()), start, int16, count)
    top = builder.shl(builder.zext(bits, int32), ir.Constant(int32, [16] * count))
    return builder.bitcast(top, vir.vector_type(vir.F32, count))


def bf16_dequantize(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


F32_FORMAT = WeightFormat(GGMLType.F32, 1, 4, lambda blocks: blocks.view("<f4").astype(np.float32),
                          lambda values: values, vir.float_row_loop(f32_load))
F16_FORMAT = WeightFormat(GGMLType.F16, 1, 2, lambda blocks: blocks.view("<f2").astype(np.float32),
                          lambda values: values.astype(np.float16), vir.float_row_loop(f16_load))
BF16_FORMAT = WeightFormat(GGMLType.BF16, 1, 2, bf16_dequantize, row_values=vir.float_row_loop(bf16_load))
