"""The LLVM vector IR that the formats' row loops (`WeightFormat.row_values`) and the decode step's
products (pyml/package/quantized_dot.py) are written in: loads of a few bytes as one vector,
lanes, splats, the float16 scales of a block.

Generic vector types: LLVM splits them into the registers of whatever CPU it compiles for (one
AVX-512 register holds 16 float32 lanes). The same loops written as Python indexing stay scalar:
numba widens every uint8 operation to int64, and LLVM then neither narrows nor vectorizes it; the
vector form ran 7x faster (2026-12-01, one core, a 1536x576 Q4_1 matrix: 22.6 against 3.3 billion
weights/s)."""

from llvmlite import ir
from numba.core import cgutils

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32, F16 = ir.FloatType(), ir.HalfType()


def vector_type(element, lanes):
    return ir.VectorType(element, lanes)


def index(value):
    return ir.Constant(I64, value)


def byte_vector(value, lanes):
    return ir.Constant(vector_type(I8, lanes), [value] * lanes)


def load(builder, base, offset, element, lanes):
    """The `lanes` consecutive elements at base[offset], as one vector."""
    pointer = builder.gep(base, [offset])
    return builder.load(builder.bitcast(pointer, vector_type(element, lanes).as_pointer()), align=1)


def lanes(builder, vector, start, count):
    """Lanes start .. start + count - 1 of `vector`."""
    mask = ir.Constant(vector_type(I32, count), list(range(start, start + count)))
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), mask)


def splat(builder, scalar, count):
    """A float32 `scalar` in each of `count` lanes."""
    vector = builder.insert_element(ir.Constant(vector_type(F32, count), ir.Undefined), scalar,
                                    ir.Constant(I32, 0))
    mask = ir.Constant(vector_type(I32, count), [0] * count)
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), mask)


def lane_splat(builder, vector, lane, count):
    """Lane `lane` of `vector` in each of `count` lanes."""
    mask = ir.Constant(vector_type(I32, count), [lane] * count)
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), mask)


def bytes_at(builder, data, positions):
    """The vector of data's lanes at `positions` (an index past data's lanes: 0)."""
    zeros = ir.Constant(data.type, [0] * data.type.count)
    mask = [p if p is not None else data.type.count for p in positions]
    return builder.shuffle_vector(data, zeros, ir.Constant(vector_type(I32, len(mask)), mask))


def half_at(builder, block, offset):
    """The float16 at byte `offset` of `block` (an i8 pointer), widened to float32 (exactly)."""
    pointer = builder.bitcast(builder.gep(block, [index(offset)]), F16.as_pointer())
    return builder.fpext(builder.load(pointer, align=1), F32)


def nibbles_at(builder, block, offset):
    """The 16 bytes at byte `offset` of `block` as (low nibbles, high nibbles), <16 x i8> each."""
    packed = load(builder, block, index(offset), I8, 16)
    return builder.and_(packed, byte_vector(15, 16)), builder.lshr(packed, byte_vector(4, 16))


def block_loop(builder, values, block_values, block_bytes, row):
    """`for block in range(values // block_values)` over the row at `row` (an i8 pointer): a
    context giving (block's first byte, index of its first value)."""
    return _BlockLoop(builder, values, block_values, block_bytes, row)


class _BlockLoop:
    def __init__(self, builder, values, block_values, block_bytes, row):
        self.builder, self.row = builder, row
        self.block_values, self.block_bytes = block_values, block_bytes
        self.loop = cgutils.for_range(builder, builder.udiv(values, index(block_values)))

    def __enter__(self):
        loop = self.loop.__enter__()
        builder = self.builder
        return (builder.gep(self.row, [builder.mul(loop.index, index(self.block_bytes))]),
                builder.mul(loop.index, index(self.block_values)))

    def __exit__(self, *exc):
        return self.loop.__exit__(*exc)


def float_row_loop(load_values):
    """The row loop of plain floats: `load_values(builder, row, start, count)` gives values start ..
    start + count - 1 as float32. 64 values at a time (4 vectors: the dot products' 4 partial
    sums), then 16, then one by one: a row may have any length."""

    def loop(builder, row, values, use):
        by_64 = builder.mul(builder.udiv(values, index(64)), index(64))
        by_16 = builder.mul(builder.udiv(values, index(16)), index(16))
        with cgutils.for_range(builder, builder.udiv(values, index(64))) as chunk:
            start = builder.mul(chunk.index, index(64))
            use(load_values(builder, row, start, 64), start)
        with cgutils.for_range(builder, builder.udiv(builder.sub(by_16, by_64), index(16))) as chunk:
            start = builder.add(by_64, builder.mul(chunk.index, index(16)))
            use(load_values(builder, row, start, 16), start)
        with cgutils.for_range(builder, builder.sub(values, by_16)) as value:
            start = builder.add(by_16, value.index)
            use(load_values(builder, row, start, 1), start)

    return loop
