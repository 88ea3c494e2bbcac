"""Dot products of one quantized weight row with one float32 row, for the generated quantized linear
kernels (templates/cpu/quantized_linear.py.j2), which import them.

Each is a numba intrinsic that writes its loop in LLVM vector IR. The same loop written as Python indexing stays scalar: numba widens every uint8
operation to int64, and LLVM then neither narrows nor vectorizes it; the vector form ran 7x
faster (2026-12-01, one core, a 1536x576 Q4_1 matrix: 22.6 against 3.3 billion weights/s).
Generic vector types, no target intrinsics: LLVM splits them into the registers of whatever CPU
it compiles for (one AVX-512 register holds 16 float32 lanes).

Each weight is dequantized as gguf's and llama.cpp's reference dequantizers do, value =
q * scale + offset in float32 (q * scale is exact: a 4- to 8-bit integer times a scale with an
11-bit float16 significand times a 6- or 8-bit integer), then multiplied by x and summed in
float32, 16 lanes per partial sum and 4 partial sums, reduced at the end of the row. So on small
integers (scale 1, offset 0) the result is exactly the exact model's dot product, and on real
weights it is gguf's dequantization times x up to float32 summation order.

Layouts (what pyml/runtime/gguf_quantized.py keeps: the GGUF's packed bytes, the scales decoded):
  q4: 4-bit values in runs of `run` bytes (Q4_0 and Q4_1: 16, Q4_K: 32). A run holds 2 * run
      values: its low nibbles the first run of them, its high nibbles the next. A scale and an
      offset per 32 values.
  q5: Q5_0: the low four bits as q4's runs of 16, and per 32 values 4 bytes of fifth bits (bit j
      of the little-endian 32-bit word: value j); value = (q - 16) * scale, as q * scale + offset
      with offset = -16 * scale (both products exact, so their sum is (q - 16) * scale exactly).
  q8: int8 values (Q8_0), a scale per 32.
  q6: per 128 values (Q6_K), 64 bytes of low nibbles (values 0..63 in the low nibbles, 64..127 in
      the high ones) and 32 bytes of 2-bit high parts (bits 2k, 2k+1 of byte i: value 32k + i);
      q = low | high << 4, value = (q - 32) * scale, a scale per 16 values.

Numba's cache does not notice when a function a cached kernel calls changes in another file, so the
generated kernel modules carry this module's hash in their first line (as for vector_math).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

QDOT_LANES = 16
QDOT_PARTIAL_SUMS = 4
QDOT_I8, QDOT_I32, QDOT_I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
QDOT_F32 = ir.FloatType()


def qdot_vector_type(element, lanes):
    return ir.VectorType(element, lanes)


def qdot_index(value):
    return ir.Constant(QDOT_I64, value)


def qdot_bytes(value, lanes):
    return ir.Constant(qdot_vector_type(QDOT_I8, lanes), [value] * lanes)


def qdot_load(builder, base, offset, element, lanes):
    """The `lanes` consecutive elements at base[offset], as one vector."""
    pointer = builder.gep(base, [offset])
    return builder.load(builder.bitcast(pointer, qdot_vector_type(element, lanes).as_pointer()), align=1)


def qdot_lanes(builder, vector, start, lanes):
    """Lanes start .. start + lanes - 1 of `vector`."""
    mask = ir.Constant(qdot_vector_type(QDOT_I32, lanes), list(range(start, start + lanes)))
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), mask)


def qdot_splat(builder, scalar, lanes):
    vector_type = qdot_vector_type(QDOT_F32, lanes)
    vector = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(QDOT_I32, 0))
    mask = ir.Constant(qdot_vector_type(QDOT_I32, lanes), [0] * lanes)
    return builder.shuffle_vector(vector, ir.Constant(vector_type, ir.Undefined), mask)


def qdot_scalar(builder, base, index):
    return builder.load(builder.gep(base, [index]))


def qdot_row(context, builder, array_type, value, row):
    """(pointer to row `row`, row length) of a C-contiguous 2-D array."""
    array = context.make_array(array_type)(context, builder, value)
    columns = builder.extract_value(array.shape, 1)
    return builder.gep(array.data, [builder.mul(row, columns)]), columns


class QdotPartialSums:
    """QDOT_PARTIAL_SUMS float32 vectors of QDOT_LANES, in stack slots that LLVM keeps in registers;
    products are added to them in turn, so consecutive adds do not wait for each other."""

    def __init__(self, builder):
        zero = ir.Constant(qdot_vector_type(QDOT_F32, QDOT_LANES), [0.0] * QDOT_LANES)
        self.builder, self.next = builder, 0
        self.slots = [cgutils.alloca_once_value(builder, zero) for _ in range(QDOT_PARTIAL_SUMS)]

    def add_products(self, weights, x):
        builder = self.builder
        for start in range(0, weights.type.count, QDOT_LANES):
            product = builder.fmul(qdot_lanes(builder, weights, start, QDOT_LANES),
                                   qdot_lanes(builder, x, start, QDOT_LANES))
            slot = self.slots[self.next % QDOT_PARTIAL_SUMS]
            builder.store(builder.fadd(builder.load(slot), product), slot)
            self.next += 1

    def total(self):
        builder = self.builder
        vector = builder.load(self.slots[0])
        for slot in self.slots[1:]:
            vector = builder.fadd(vector, builder.load(slot))
        reduce = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(QDOT_F32, [QDOT_F32, vector.type]),
            f"llvm.vector.reduce.fadd.v{QDOT_LANES}f32")
        return builder.call(reduce, [ir.Constant(QDOT_F32, 0.0), vector])


def qdot_check(*arrays):
    for array in arrays:
        if not isinstance(array, types.Array) or array.ndim != 2 or array.layout != "C":
            raise TypeError(f"a quantized dot product takes C-contiguous 2-D arrays, not {array}")


def qdot_q4_intrinsic(run_bytes):
    """The dot product of a 4-bit row whose values come in runs of `run_bytes` (16 or 32) bytes."""

    @intrinsic
    def q4_row_dot(typingctx, values, scale, offset, x, row, sample):
        """sum_k W[row, k] * x[sample, k], W in 4 bits: values (rows, in / 2) uint8, scale and
        offset (rows, in / 32) float32, x (samples, in) float32."""
        qdot_check(values, scale, offset, x)

        def codegen(context, builder, signature, args):
            q_row, row_bytes = qdot_row(context, builder, signature.args[0], args[0], args[4])
            scale_row, _ = qdot_row(context, builder, signature.args[1], args[1], args[4])
            offset_row, _ = qdot_row(context, builder, signature.args[2], args[2], args[4])
            x_row, _ = qdot_row(context, builder, signature.args[3], args[3], args[5])
            sums = QdotPartialSums(builder)
            with cgutils.for_range(builder, builder.udiv(row_bytes, qdot_index(run_bytes))) as loop:
                packed = qdot_load(builder, q_row, builder.mul(loop.index, qdot_index(run_bytes)),
                                   QDOT_I8, run_bytes)
                nibbles = (builder.and_(packed, qdot_bytes(15, run_bytes)),
                           builder.lshr(packed, qdot_bytes(4, run_bytes)))
                for half in range(2):
                    # the 32-value block of this half of the run (a 16-byte run is one block)
                    block = (builder.add(builder.mul(loop.index, qdot_index(2)), qdot_index(half))
                             if run_bytes == 32 else loop.index)
                    q = builder.uitofp(nibbles[half], qdot_vector_type(QDOT_F32, run_bytes))
                    weights = builder.fadd(
                        builder.fmul(q, qdot_splat(builder, qdot_scalar(builder, scale_row, block), run_bytes)),
                        qdot_splat(builder, qdot_scalar(builder, offset_row, block), run_bytes))
                    start = builder.add(builder.mul(loop.index, qdot_index(2 * run_bytes)),
                                        qdot_index(half * run_bytes))
                    sums.add_products(weights, qdot_load(builder, x_row, start, QDOT_F32, run_bytes))
            return sums.total()

        return types.float32(values, scale, offset, x, row, sample), codegen

    return q4_row_dot


q4_row_dot_runs_of_16 = qdot_q4_intrinsic(16)  # Q4_0, Q4_1
q4_row_dot_runs_of_32 = qdot_q4_intrinsic(32)  # Q4_K


@intrinsic
def q5_row_dot(typingctx, values, high, scale, offset, x, row, sample):
    """sum_k W[row, k] * x[sample, k], W in 5 bits (Q5_0): values (rows, in / 2) and high
    (rows, in / 8) uint8, scale and offset (rows, in / 32) float32, x (samples, in) float32."""
    qdot_check(values, high, scale, offset, x)

    def codegen(context, builder, signature, args):
        q_row, row_bytes = qdot_row(context, builder, signature.args[0], args[0], args[5])
        high_row, _ = qdot_row(context, builder, signature.args[1], args[1], args[5])
        scale_row, _ = qdot_row(context, builder, signature.args[2], args[2], args[5])
        offset_row, _ = qdot_row(context, builder, signature.args[3], args[3], args[5])
        x_row, _ = qdot_row(context, builder, signature.args[4], args[4], args[6])
        sums = QdotPartialSums(builder)
        with cgutils.for_range(builder, builder.udiv(row_bytes, qdot_index(16))) as loop:
            block = loop.index  # 32 values: 16 bytes of nibbles, 4 bytes of fifth bits
            packed = qdot_load(builder, q_row, builder.mul(block, qdot_index(16)), QDOT_I8, 16)
            fifth = qdot_load(builder, high_row, builder.mul(block, qdot_index(4)), QDOT_I8, 4)
            nibbles = (builder.and_(packed, qdot_bytes(15, 16)), builder.lshr(packed, qdot_bytes(4, 16)))
            for half in range(2):  # values 16 * half + i, i < 16: bit i % 8 of byte 2 * half + i // 8
                spread = builder.shuffle_vector(
                    fifth, ir.Constant(fifth.type, ir.Undefined),
                    ir.Constant(qdot_vector_type(QDOT_I32, 16), [2 * half + i // 8 for i in range(16)]))
                bits = builder.and_(
                    builder.lshr(spread, ir.Constant(qdot_vector_type(QDOT_I8, 16), [i % 8 for i in range(16)])),
                    qdot_bytes(1, 16))
                q = builder.or_(nibbles[half], builder.shl(bits, qdot_bytes(4, 16)))
                q = builder.uitofp(q, qdot_vector_type(QDOT_F32, 16))
                weights = builder.fadd(
                    builder.fmul(q, qdot_splat(builder, qdot_scalar(builder, scale_row, block), 16)),
                    qdot_splat(builder, qdot_scalar(builder, offset_row, block), 16))
                start = builder.add(builder.mul(block, qdot_index(32)), qdot_index(16 * half))
                sums.add_products(weights, qdot_load(builder, x_row, start, QDOT_F32, 16))
        return sums.total()

    return types.float32(values, high, scale, offset, x, row, sample), codegen


@intrinsic
def q8_row_dot(typingctx, values, scale, x, row, sample):
    """sum_k W[row, k] * x[sample, k], W in 8 bits: values (rows, in) int8, scale (rows, in / 32)
    float32, x (samples, in) float32."""
    qdot_check(values, scale, x)

    def codegen(context, builder, signature, args):
        q_row, row_length = qdot_row(context, builder, signature.args[0], args[0], args[3])
        scale_row, _ = qdot_row(context, builder, signature.args[1], args[1], args[3])
        x_row, _ = qdot_row(context, builder, signature.args[2], args[2], args[4])
        sums = QdotPartialSums(builder)
        with cgutils.for_range(builder, builder.udiv(row_length, qdot_index(32))) as loop:
            start = builder.mul(loop.index, qdot_index(32))
            weights = builder.fmul(
                builder.sitofp(qdot_load(builder, q_row, start, QDOT_I8, 32), qdot_vector_type(QDOT_F32, 32)),
                qdot_splat(builder, qdot_scalar(builder, scale_row, loop.index), 32))
            sums.add_products(weights, qdot_load(builder, x_row, start, QDOT_F32, 32))
        return sums.total()

    return types.float32(values, scale, x, row, sample), codegen


@intrinsic
def q6_row_dot(typingctx, low, high, scale, x, row, sample):
    """sum_k W[row, k] * x[sample, k], W in 6 bits (Q6_K): low (rows, in / 2) and high
    (rows, in / 4) uint8, scale (rows, in / 16) float32, x (samples, in) float32."""
    qdot_check(low, high, scale, x)

    def codegen(context, builder, signature, args):
        low_row, low_bytes = qdot_row(context, builder, signature.args[0], args[0], args[4])
        high_row, _ = qdot_row(context, builder, signature.args[1], args[1], args[4])
        scale_row, _ = qdot_row(context, builder, signature.args[2], args[2], args[4])
        x_row, _ = qdot_row(context, builder, signature.args[3], args[3], args[5])
        sums = QdotPartialSums(builder)
        with cgutils.for_range(builder, builder.udiv(low_bytes, qdot_index(64))) as loop:
            group = loop.index  # 128 values
            low = qdot_load(builder, low_row, builder.mul(group, qdot_index(64)), QDOT_I8, 64)
            high = qdot_load(builder, high_row, builder.mul(group, qdot_index(32)), QDOT_I8, 32)
            for k in range(4):  # values 32k .. 32k + 31 of the group
                source = qdot_lanes(builder, low, 32 * (k % 2), 32)
                nibble = (builder.and_(source, qdot_bytes(15, 32)) if k < 2
                          else builder.lshr(source, qdot_bytes(4, 32)))
                high_bits = builder.and_(builder.lshr(high, qdot_bytes(2 * k, 32)), qdot_bytes(3, 32))
                q = builder.sub(builder.or_(nibble, builder.shl(high_bits, qdot_bytes(4, 32))),
                                qdot_bytes(32, 32))
                q = builder.sitofp(q, qdot_vector_type(QDOT_F32, 32))
                first_scale = builder.add(builder.mul(group, qdot_index(8)), qdot_index(2 * k))
                for half in range(2):  # 16 values per scale
                    weights = builder.fmul(
                        qdot_lanes(builder, q, 16 * half, 16),
                        qdot_splat(builder, qdot_scalar(builder, scale_row, builder.add(first_scale, qdot_index(half))), 16))
                    start = builder.add(builder.mul(group, qdot_index(128)), qdot_index(32 * k + 16 * half))
                    sums.add_products(weights, qdot_load(builder, x_row, start, QDOT_F32, 16))
        return sums.total()

    return types.float32(low, high, scale, x, row, sample), codegen
