"""The dot products of the fused decode step (decode_cpu.py, which imports them): of weight rows,
read where their file stores them, with float32 rows of x; the dequantization of such rows (the
embedding, a LoRA base's tiles); and, for the decode step's --activations q8_0, the products of 16
rows at a time with int8-rounded activations (the section at the end).

Each is a numba intrinsic that writes its loop in LLVM vector IR (pyml/weight_formats/vector_ir.py
says why), around each format's own loop over a row's blocks (`WeightFormat.row_values`). The one
target intrinsic, AVX-512 VNNI's vpdpbusd for the int8 products, is used only where the CPU has it.

Each weight is dequantized as gguf's and llama.cpp's reference dequantizers do, in float32 (every
product of a stored integer and its block's scales is exact: a 4- to 8-bit integer times a scale
with an 11-bit float16 significand times a 6- or 8-bit integer), then multiplied by x and summed
in float32, 16 lanes per partial sum and 4 partial sums, reduced at the end of the row. So on
small integers the result is exactly the exact model's dot product, and on real weights it is
gguf's dequantization times x up to float32 summation order. The formats' modules give the
layouts of the rows; this module's section "int8 activations" the rows-by-16 one.

Numba's cache does not notice when a function a cached kernel calls changes in another file, so the
generated kernel modules carry this module's and the formats' hash in their first line (as for
vector_math).
"""


import hashlib

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pyml.weight_formats import vector_ir as vir

QDOT_LANES = 16
QDOT_PARTIAL_SUMS = 4


def qdot_padded(builder, vector):
    """`vector` (fewer than QDOT_LANES lanes) followed by zeros, QDOT_LANES lanes in all."""
    lanes = vector.type.count
    zeros = ir.Constant(vector.type, [ir.Constant(vector.type.element, 0.0)] * lanes)
    mask = ir.Constant(vir.vector_type(vir.I32, QDOT_LANES), list(range(lanes)) + [lanes] * (QDOT_LANES - lanes))
    return builder.shuffle_vector(vector, zeros, mask)


def qdot_row(context, builder, array_type, value, row):
    """(pointer to row `row`, row length) of a C-contiguous 2-D array."""
    array = context.make_array(array_type)(context, builder, value)
    columns = builder.extract_value(array.shape, 1)
    return builder.gep(array.data, [builder.mul(row, columns)]), columns


class QdotPartialSums:
    """QDOT_PARTIAL_SUMS float32 vectors of QDOT_LANES, in stack slots that LLVM keeps in registers;
    products are added to them in turn, so consecutive adds do not wait for each other."""

    def __init__(self, builder):
        zero = ir.Constant(vir.vector_type(vir.F32, QDOT_LANES), [0.0] * QDOT_LANES)
        self.builder, self.next = builder, 0
        self.slots = [cgutils.alloca_once_value(builder, zero) for _ in range(QDOT_PARTIAL_SUMS)]

    def add_products(self, weights, x):
        builder = self.builder
        if weights.type.count < QDOT_LANES:  # a float row's last values: the other lanes add 0
            weights, x = qdot_padded(builder, weights), qdot_padded(builder, x)
        for start in range(0, weights.type.count, QDOT_LANES):
            product = builder.fmul(vir.lanes(builder, weights, start, QDOT_LANES),
                                   vir.lanes(builder, x, start, QDOT_LANES))
            slot = self.slots[self.next % QDOT_PARTIAL_SUMS]
            builder.store(builder.fadd(builder.load(slot), product), slot)
            self.next += 1

    def total(self):
        builder = self.builder
        vector = builder.load(self.slots[0])
        for slot in self.slots[1:]:
            vector = builder.fadd(vector, builder.load(slot))
        reduce = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vir.F32, [vir.F32, vector.type]),
            f"llvm.vector.reduce.fadd.v{QDOT_LANES}f32")
        return builder.call(reduce, [ir.Constant(vir.F32, 0.0), vector])


class QdotSamples:
    """The float32 rows x[sample], ..., x[sample + count - 1] that one weight row multiplies, each
    with partial sums of its own. Each weight vector is dequantized once and multiplied by every
    row, and each row's products are added in the same order whatever `count` is: its sum is the
    same, bit for bit, as when it is multiplied alone (count 1)."""

    def __init__(self, context, builder, x_type, x, sample, count):
        self.builder = builder
        self.rows = [qdot_row(context, builder, x_type, x, builder.add(sample, ir.Constant(sample.type, g)))[0]
                     for g in range(count)]
        self.sums = [QdotPartialSums(builder) for _ in range(count)]

    def add_products(self, weights, start):
        """Add weights times each row's values start .. start + len(weights) - 1."""
        for row, sums in zip(self.rows, self.sums):
            sums.add_products(weights, vir.load(self.builder, row, start, vir.F32, weights.type.count))

    def store(self, context, y_type, y, sample, column):
        """y[sample + g, column] = row g's sum (float32, converted to y's dtype)."""
        builder = self.builder
        for g, sums in enumerate(self.sums):
            y_row, _ = qdot_row(context, builder, y_type, y, builder.add(sample, ir.Constant(sample.type, g)))
            total = context.cast(builder, sums.total(), types.float32, y_type.dtype)
            builder.store(total, builder.gep(y_row, [column]))


def qdot_check(*arrays):
    for array in arrays:
        if not isinstance(array, types.Array) or array.ndim != 2 or array.layout != "C":
            raise TypeError(f"a quantized dot product takes C-contiguous 2-D arrays, not {array}")


# the rows of x a weight row is decoded once for (a batch of sequences decoded together; 4 rows'
# partial sums, 16 vectors of 16 lanes, fill the 32 AVX-512 registers by half)
QDOT_SAMPLES = 4


# --- rows read where they are stored ----------------------------------------------------------------
#
# A weight row is given by the absolute address of its first byte (in a memory map of the model's
# GGUF or safetensors file), its bytes exactly as the file stores them: blocks
# one after another, each with its float16 scale(s) beside its packed integers (pyml/weight_formats
# gives the layouts), or plain little-endian floats. Nothing is copied or decoded ahead: a row's
# blocks are decoded as they are read, the float16 scales widened to float32 in the loop.
#
# Each format's loop (`WeightFormat.row_values`) decodes the row into float32 vectors in order,
# handing each to `use(weights, start)` (the vector holds values start ..): the dot products add it
# to their partial sums, the embedding stores it. Each value is computed as the format's numpy
# dequantizer computes it, in float32, so the embedding's rows are its bits; the dot products add
# the same weights, value after value, to QdotSamples' partial sums in turn. (Until 2026-12-05 the
# step read split arrays, the scales decoded ahead; these loops gave their products bit for bit, so
# reading the rows in place changed no token.)
#
# A call covers a range of rows of one kind (a GGML type id): the switch on the kind is taken once
# per range, outside the loop over its rows, so the loop holds that kind's code alone (a switch on
# every row of one parallel loop made the products 1.5x slower, 2026-12-05).


def stored_kinds(builder, kind, loops, case):
    """`case(loop)` for the kind's entry in `loops`, picked by a switch (a kind not in `loops`
    does nothing)."""
    done = builder.append_basic_block("stored_kind_done")
    switch = builder.switch(kind, done)
    for code, loop in loops.items():
        block = builder.append_basic_block(f"stored_kind_{code}")
        switch.add_case(ir.Constant(kind.type, int(code)), block)
        builder.position_at_end(block)
        case(code, loop)
        builder.branch(done)
    builder.position_at_end(done)


def stored_outlined(builder, name, values, body):
    """Call `body(inner_builder, *arguments)`, emitted as a function of its own (internal, not
    inlined) that takes `values`: each kind's loop over its rows is then optimized alone. With
    every kind's loop in one function, LLVM optimized them worse (one Q8_0 row at a time: 0.39 ms
    against 0.22 for an 8960 x 1536 matrix, 2026-12-06)."""
    function_type = ir.FunctionType(ir.VoidType(), [value.type for value in values])
    function = cgutils.get_or_insert_function(builder.module, function_type, name)
    if function.is_declaration:
        function.linkage = "internal"
        function.attributes.add("noinline")
        inner = ir.IRBuilder(function.append_basic_block("entry"))
        body(inner, *function.args)
        inner.ret_void()
    builder.call(function, values)


def stored_function_name(what, code, signature):
    """A name for `what`'s function of kind `code` under `signature`, unique in its module."""
    digest = hashlib.sha256(str(signature).encode()).hexdigest()[:12]
    return f"pyml_{what}_{int(code)}_{digest}"


def stored_integer(value):
    if not isinstance(value, types.Integer):
        raise TypeError(f"a row's kind, address and index are integers, not {value}")


def stored_addresses(addresses):
    if not isinstance(addresses, types.Array) or addresses.ndim != 1 or addresses.dtype != types.uint64:
        raise TypeError(f"rows are given by a 1-D uint64 array of addresses, not {addresses}")


def stored_address(context, builder, addresses_type, addresses, row):
    """The i8 pointer addresses[row]."""
    data = context.make_array(addresses_type)(context, builder, addresses).data
    return builder.inttoptr(builder.load(builder.gep(data, [row])), vir.I8.as_pointer())


def stored_rows_products(loops):
    """The intrinsic f(kind, addresses, x, first, stop, y): y[b, row] = sum_k W_row[k] * x[b, k]
    for each row of x and each row in first .. stop - 1, W_row the row of x.shape[1] values whose
    first byte is at addresses[row], in the layout of loops[kind] (a format's `row_values`): x (B,
    in) float32 and y (B, rows) C-contiguous (the sum in float32, converted to y's dtype). The
    rows of x are taken QDOT_SAMPLES at a time, the weight row decoded once for them, then one at
    a time; each keeps sums of its own, so its result is the same bits whatever B is (QdotSamples)."""

    def codegen(context, builder, signature, args):
        kind, addresses, x, first, stop, y = args
        _, addresses_type, x_type, first_type, stop_type, y_type = signature.args
        first, stop = (context.cast(builder, value, value_type, types.int64)
                       for value, value_type in ((first, first_type), (stop, stop_type)))

        def rows(builder, loop, addresses, x, first, stop, y):
            x_shape = context.make_array(x_type)(context, builder, x).shape
            batch, columns = builder.extract_value(x_shape, 0), builder.extract_value(x_shape, 1)
            whole = builder.mul(builder.udiv(batch, vir.index(QDOT_SAMPLES)), vir.index(QDOT_SAMPLES))
            with cgutils.for_range_slice(builder, first, stop, vir.index(1)) as (row, _):
                first_byte = stored_address(context, builder, addresses_type, addresses, row)

                def products(sample, count):
                    samples = QdotSamples(context, builder, x_type, x, sample, count)
                    loop(builder, first_byte, columns, samples.add_products)
                    samples.store(context, y_type, y, sample, row)

                with cgutils.for_range(builder, builder.udiv(whole, vir.index(QDOT_SAMPLES))) as group:
                    products(builder.mul(group.index, vir.index(QDOT_SAMPLES)), QDOT_SAMPLES)
                with cgutils.for_range(builder, builder.sub(batch, whole)) as one:
                    products(builder.add(whole, one.index), 1)

        def case(code, loop):
            stored_outlined(builder, stored_function_name("rows_products", code, signature),
                            [addresses, x, first, stop, y],
                            lambda inner, *values: rows(inner, loop, *values))

        stored_kinds(builder, kind, loops, case)
        return context.get_dummy_value()

    @intrinsic
    def rows_products(typingctx, kind, addresses, x, first, stop, y):
        for value in (kind, first, stop):
            stored_integer(value)
        stored_addresses(addresses)
        qdot_check(x, y)
        return types.none(kind, addresses, x, first, stop, y), codegen

    return rows_products


def stored_rows_values(loops):
    """The intrinsic f(kind, addresses, first, stop, out, out_first): out[out_first + r - first] =
    the row of out.shape[1] values at addresses[r], in the layout of loops[kind] (a format's
    `row_values`), dequantized in float32 (the format's numpy dequantizer's bits) and converted to
    out's dtype, for r in first .. stop - 1; out 2-D C-contiguous, float32 or float64."""

    def codegen(context, builder, signature, args):
        kind, addresses, first, stop, out, out_first = args
        _, addresses_type, first_type, stop_type, out_type, out_first_type = signature.args
        element = context.get_value_type(out_type.dtype)
        first, stop, out_first = (context.cast(builder, value, value_type, types.int64) for value, value_type in
                                  ((first, first_type), (stop, stop_type), (out_first, out_first_type)))

        def rows(builder, loop, addresses, first, stop, out, out_first):
            with cgutils.for_range_slice(builder, first, stop, vir.index(1)) as (row, _):
                out_row, columns = qdot_row(context, builder, out_type, out,
                                            builder.add(out_first, builder.sub(row, first)))

                def store(weights, start):
                    if element != vir.F32:
                        weights = builder.fpext(weights, vir.vector_type(element, weights.type.count))
                    builder.store(weights, builder.bitcast(builder.gep(out_row, [start]), weights.type.as_pointer()),
                                  align=1)

                loop(builder, stored_address(context, builder, addresses_type, addresses, row), columns, store)

        def case(code, loop):
            stored_outlined(builder, stored_function_name("rows_values", code, signature),
                            [addresses, first, stop, out, out_first],
                            lambda inner, *values: rows(inner, loop, *values))

        stored_kinds(builder, kind, loops, case)
        return context.get_dummy_value()

    @intrinsic
    def rows_values(typingctx, kind, addresses, first, stop, out, out_first):
        for value in (kind, first, stop, out_first):
            stored_integer(value)
        stored_addresses(addresses)
        qdot_check(out)
        if out.dtype not in (types.float32, types.float64):
            raise TypeError(f"a row is dequantized into float32 or float64, not {out.dtype}")
        return types.none(kind, addresses, first, stop, out, out_first), codegen

    return rows_values


@intrinsic
def stored_float64(typingctx, address, index):
    """Value `index` of the row of little-endian float64 values whose first byte is at `address`
    (a float64 model's rows: scalar code is enough for its exact tests)."""
    stored_integer(address)
    stored_integer(index)

    def codegen(context, builder, signature, args):
        address, index = args
        row = builder.inttoptr(address, ir.DoubleType().as_pointer())
        return builder.load(builder.gep(row, [index]), align=1)

    return types.float64(address, index), codegen


# --- int8 activations (`pyml generate --activations q8_0`) ----------------------------------------
#
# llama.cpp's CPU products round the activations too: each run of 32 values of x to int8 times a
# float32 scale d = max |x| / 127 (its Q8_0 and Q8_1). A block's product is then an integer dot
# product, 32 products of a 4- or 8-bit weight and an 8-bit activation summed exactly in int32,
# times the two blocks' scales. On an AVX-512 VNNI CPU one vpdpbusd instruction does 64 of those
# products into 16 int32 lanes (lane j adds the 4 products of bytes 4j .. 4j + 3); elsewhere the
# same lanes come from generic vector IR. Both give the same integers, and everything after is the
# same float32 arithmetic, so the two paths give the same results bit for bit.
#
# The products are taken 16 output rows at a time, in the order llama.cpp's CPU "extra buffer
# types" repack the weights into: 16 rows in the 16 lanes, so that one vpdpbusd multiplies 4
# consecutive weights of each of 16 rows by the same 4 activations (broadcast to every lane), the
# block scales of 16 rows are one vector, and no lane is ever summed across. (2026-12-02, 2
# threads, SmolLM2's three shapes, weights in cache: 87, 103 and 75 billion weights/s, against 30,
# 39 and 25 for an int8 dot of one row at a time, which sums its lanes at the end of each row.)
#
#   rows by 16: per group of 16 rows and block of 32 values, runs of 64 bytes, run j holding, for
#     each row r in turn, bytes 4j .. 4j + 3 of that row's block integers: 4 runs for Q4_0 and
#     Q4_1 (low nibbles: values 4j .. 4j + 3; high nibbles: values 16 + 4j ..), 8 for Q8_0
#     (values 4j .. 4j + 3, read as w + 128, unsigned, the product corrected by 128 * sum(x)).
#     The 16 rows' scales (and Q4_1 offsets, Q4_0's -8 d) as one float32 vector per block.
#
# Until 2026-12-06 the layers were repacked so into a copy at load (twice the file's memory for a
# Q8_0 model, about 4.7 s of 1.5B Q8_0's first token). Now each block of 16 rows is read where the
# file stores it and put in that order in registers (qdot_transposed: 24 shuffles of a Q8_0 block, 8
# of a Q4 one), once for up to 8 rows of x; the same integers and float32 steps, so the same bits.
# Measured against the copy (2026-12-06, 2 threads, 12 matrices of 3 layers of the bench GGUFs,
# alternated): 1.5B Q8_0 one sequence 3.7 ms against 3.0, 32 sequences 15.6 against 13.1; 8B Q4_0
# 7.9 against 7.6 and 61.7 against 52.6. Taking all rows of x per transposed block (sums in memory)
# was no faster; a one-row-at-a-time int8 dot for decode (not tried) would need a sum across lanes
# per block to keep these bits. The last group of a matrix whose rows are not a multiple of 16 reads its last row again in
# the lanes past it and writes only the rows the output has.
#
# The rounding changes the results: a product's relative error grows from float32's 1e-7 to about
# 5e-3 (1/254 of a block's largest value per activation). So it is an option, off by default.

QDOT_GROUP_ROWS = 16


def qdot_target_has_vnni() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (its host unless NUMBA_CPU_NAME says)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME and not config.CPU_FEATURES:
        return False  # a named portable target: features are the name's, assume none
    features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+avx512vnni" in features.split(",")


QDOT_VNNI = qdot_target_has_vnni()


def qdot_byte_dots(builder, total, unsigned, signed):
    """total (<16 x i32>) plus, in lane j, the exact sum of unsigned[4j + i] * signed[4j + i] over
    i < 4: `unsigned` <64 x i8> read as unsigned bytes, `signed` <16 x i32> read as 64 signed ones."""
    lanes, bytes_type = vir.vector_type(vir.I32, 16), vir.vector_type(vir.I8, 64)
    if QDOT_VNNI:
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lanes, [lanes] * 3),
                                                  "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(function, [total, builder.bitcast(unsigned, lanes), signed])
    sums = builder.mul(builder.zext(unsigned, vir.vector_type(vir.I32, 64)),
                       builder.sext(builder.bitcast(signed, bytes_type), vir.vector_type(vir.I32, 64)))
    for count in (32, 16):  # add neighbouring lanes twice: lane j holds products 4j .. 4j + 3
        undefined = ir.Constant(sums.type, ir.Undefined)
        even, odd = (builder.shuffle_vector(sums, undefined, ir.Constant(
            vir.vector_type(vir.I32, count), list(range(first, 2 * count, 2)))) for first in (0, 1))
        sums = builder.add(even, odd)
    return builder.add(total, sums)


def qdot_splat_lanes(builder, scalar, element):
    vector_type = vir.vector_type(element, 16)
    vector = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(vir.I32, 0))
    return builder.shuffle_vector(vector, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(vir.vector_type(vir.I32, 16), [0] * 16))


def qdot_transposed(builder, rows):
    """The 16 rows' words in lanes: `rows` 16 vectors <D x i32> (D = 4 or 8, a block's integers),
    returned as D vectors <16 x i32>, vector j holding word j of row r in lane r (the rows-by-16
    order above). Built as a network of two-vector shuffles (each one vpermt2d on AVX-512): the rows
    concatenated into D vectors of 16 lanes, then log2(D) stages, each pairing vectors whose index
    differs in bit s and sending the words whose index j has bit s clear to the first, set to the
    second; after the last, vector j holds word j of every row. The plan is built here, at compile
    time, from labels (row, word) of every lane."""
    words = rows[0].type.count
    vectors = [(vector, [(r, j) for j in range(words)]) for r, vector in enumerate(rows)]

    def shuffle(first, second, picks):
        (a, a_labels), (b, b_labels) = first, second
        labels = a_labels + b_labels
        mask = ir.Constant(vir.vector_type(vir.I32, len(picks)), picks)
        return builder.shuffle_vector(a, b, mask), [labels[i] for i in picks]

    while len(vectors[0][1]) < QDOT_GROUP_ROWS:  # concatenate neighbours
        vectors = [shuffle(vectors[k], vectors[k + 1], list(range(2 * len(vectors[k][1]))))
                   for k in range(0, len(vectors), 2)]
    stage = 1
    while stage < words:
        paired = list(vectors)
        for a in range(words):
            if a & stage:
                continue
            labels = vectors[a][1] + vectors[a | stage][1]
            for target, bit in ((a, 0), (a | stage, stage)):
                picks = sorted((i for i, (_, j) in enumerate(labels) if j & stage == bit),
                               key=lambda i: (labels[i][1], labels[i][0]))
                paired[target] = shuffle(vectors[a], vectors[a | stage], picks)
        vectors, stage = paired, 2 * stage
    assert all(labels == [(r, j) for r in range(QDOT_GROUP_ROWS)] for j, (_, labels) in enumerate(vectors))
    return [vector for vector, _ in vectors]


def qdot_halves(builder, blocks, at):
    """The float16 at byte `at` of each of the 16 rows' blocks (i8 pointers), widened to float32
    (exactly), in lane r for row r."""
    half_lanes = vir.vector_type(vir.F16, QDOT_GROUP_ROWS)
    vector = ir.Constant(half_lanes, ir.Undefined)
    for r, block in enumerate(blocks):
        pointer = builder.bitcast(builder.gep(block, [vir.index(at)]), vir.F16.as_pointer())
        vector = builder.insert_element(vector, builder.load(pointer, align=1), ir.Constant(vir.I32, r))
    return builder.fpext(vector, vir.vector_type(vir.F32, QDOT_GROUP_ROWS))


def qdot_int8_group(context, builder, signature, args, format, count):
    """The 16 outputs of row group `group` for rows sample .. sample + count - 1 of x (rounded)
    and y: the codegen of `int8_rows_by_16` (`format`: the rows' WeightFormat). Each block of the
    16 rows is read where the file stores it and put rows by 16 in registers (qdot_transposed),
    once for all `count` rows of x; each row of x keeps its own sums and takes the same float32
    steps as it does alone (count 1), so its outputs are the same bits."""
    names = ("addresses", "x_values", "x_scale", "x_total", "group", "sample", "y")
    arrays = dict(zip(names, zip(signature.args[2:], args[2:])))

    def data(name):
        array_type, value = arrays[name]
        return context.make_array(array_type)(context, builder, value)

    addresses, y = data("addresses"), data("y")
    rows = builder.extract_value(y.shape, 1)
    first_row = builder.mul(arrays["group"][1], vir.index(QDOT_GROUP_ROWS))
    # the rows of this group and the next (the last group's rows past the matrix read its last row
    # again; their outputs are not stored)
    last_row = builder.sub(rows, vir.index(1))
    row_bytes = []
    for r in range(2 * QDOT_GROUP_ROWS):
        row = builder.add(first_row, vir.index(r))
        row = builder.select(builder.icmp_signed("<", row, rows), row, last_row)
        address = builder.load(builder.gep(addresses.data, [row]))
        row_bytes.append(builder.inttoptr(address, vir.I8.as_pointer()))
    row_bytes, next_row_bytes = row_bytes[:QDOT_GROUP_ROWS], row_bytes[QDOT_GROUP_ROWS:]
    prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [vir.I8.as_pointer(), vir.I32, vir.I32, vir.I32]), "llvm.prefetch.p0i8")
    x_values_array, x_scale_array = data("x_values"), data("x_scale")
    n_blocks = builder.extract_value(x_scale_array.shape, 1)
    n_columns = builder.extract_value(x_values_array.shape, 1)
    samples = [builder.add(arrays["sample"][1], vir.index(index)) for index in range(count)]
    x_rows = [builder.gep(x_values_array.data, [builder.mul(sample, n_columns)]) for sample in samples]
    scale_rows = [builder.gep(x_scale_array.data, [builder.mul(sample, n_blocks)]) for sample in samples]
    total_rows = [builder.gep(data("x_total").data, [builder.mul(sample, n_blocks)]) for sample in samples]
    float_lanes = vir.vector_type(vir.F32, 16)
    products = [cgutils.alloca_once_value(builder, ir.Constant(float_lanes, [0.0] * 16)) for _ in samples]
    offsets = [cgutils.alloca_once_value(builder, ir.Constant(float_lanes, [0.0] * 16)) for _ in samples]
    layout = format.int8
    four_bit = layout.four_bit
    words = 4 if four_bit else 8  # a block's integers: 16 bytes of nibbles, or 32 int8
    with cgutils.for_range(builder, n_blocks) as loop:
        block = loop.index
        at = builder.mul(block, vir.index(format.block_bytes))
        blocks = [builder.gep(row, [at]) for row in row_bytes]
        # 16 rows are 16 short streams, which the CPU's prefetcher does not follow: the next
        # group's rows are fetched while this one runs (1.5B Q8_0, 16 matrices, one sequence:
        # 9.8 ms against 11.7 without; 2026-12-06)
        for row in next_row_bytes:
            builder.call(prefetch, [builder.gep(row, [at]), ir.Constant(vir.I32, 0), ir.Constant(vir.I32, 3),
                                    ir.Constant(vir.I32, 1)])
        stored = [builder.load(builder.bitcast(builder.gep(start, [vir.index(layout.values_at)]),
                                               vir.vector_type(vir.I32, words).as_pointer()), align=1)
                  for start in blocks]
        runs = [builder.bitcast(run, vir.vector_type(vir.I8, 64)) for run in qdot_transposed(builder, stored)]

        def activations(index, start):  # row index's 4 int8 activations from `start`, in every lane
            block_x = builder.gep(x_rows[index], [builder.add(builder.mul(block, vir.index(32)), vir.index(start))])
            word = builder.load(builder.bitcast(block_x, vir.I32.as_pointer()), align=1)
            return qdot_splat_lanes(builder, word, vir.I32)

        integers = [ir.Constant(vir.vector_type(vir.I32, 16), [0] * 16) for _ in samples]
        for run, packed in enumerate(runs):
            if four_bit:  # low nibbles: values 4 run + i; high ones: 16 + 4 run + i
                low, high = builder.and_(packed, vir.byte_vector(15, 64)), builder.lshr(packed, vir.byte_vector(4, 64))
                for index in range(count):
                    integers[index] = qdot_byte_dots(builder, integers[index], low, activations(index, 4 * run))
                    integers[index] = qdot_byte_dots(builder, integers[index], high,
                                                     activations(index, 16 + 4 * run))
            else:
                unsigned = builder.xor(packed, vir.byte_vector(0x80, 64))
                for index in range(count):
                    integers[index] = qdot_byte_dots(builder, integers[index], unsigned,
                                                     activations(index, 4 * run))
        row_scales = qdot_halves(builder, blocks, 0)
        if four_bit and layout.offset_at is not None:
            row_offsets = qdot_halves(builder, blocks, layout.offset_at)
        elif four_bit:  # Q4_0: (q - 8) d = q d + (-8 d), -8 d exact in float32
            row_offsets = builder.fmul(row_scales, ir.Constant(float_lanes, [-8.0] * 16))
        for index in range(count):
            total = builder.load(builder.gep(total_rows[index], [block]))
            block_integers = integers[index]
            if not four_bit:  # (w + 128) x summed, less 128 * sum(x)
                block_integers = builder.sub(block_integers, qdot_splat_lanes(
                    builder, builder.mul(total, ir.Constant(vir.I32, 128)), vir.I32))
            block_scale = qdot_splat_lanes(builder, builder.load(builder.gep(scale_rows[index], [block])), vir.F32)
            builder.store(builder.fadd(builder.load(products[index]),
                                       builder.fmul(builder.sitofp(block_integers, float_lanes),
                                                    builder.fmul(row_scales, block_scale))),
                          products[index])
            if four_bit:  # offset * the block's sum of activations, d * sum(q)
                block_sum = builder.fmul(block_scale, qdot_splat_lanes(builder, builder.sitofp(total, vir.F32),
                                                                       vir.F32))
                builder.store(builder.fadd(builder.load(offsets[index]), builder.fmul(row_offsets, block_sum)),
                              offsets[index])
    # a float64 model's step compiles this branch too (it never runs it): y may be float64
    y_element = context.get_value_type(arrays["y"][0].dtype)
    left = builder.sub(rows, first_row)
    for index, sample in enumerate(samples):
        result = builder.fadd(builder.load(products[index]), builder.load(offsets[index]))
        if y_element != vir.F32:
            result = builder.fpext(result, vir.vector_type(y_element, 16))
        output = builder.gep(y.data, [builder.add(builder.mul(sample, rows), first_row)])
        with builder.if_else(builder.icmp_signed(">=", left, vir.index(QDOT_GROUP_ROWS))) as (whole, part):
            with whole:
                builder.store(result, builder.bitcast(output, result.type.as_pointer()), align=4)
            with part:  # the last group of a matrix whose rows are not a multiple of 16
                with cgutils.for_range(builder, left) as lane:
                    builder.store(builder.extract_element(result, lane.index), builder.gep(output, [lane.index]))
    return context.get_dummy_value()


def int8_rows_by_16(formats):
    """The intrinsic f(kind, count, addresses, x_values, x_scale, x_total, group, sample, y):
    y[sample + i, 16 g .. 16 g + 15] = W x[sample + i] for i < count and g = `group`, W the rows
    whose first bytes are at `addresses` ((rows,) uint64), in the format formats[kind] (a
    WeightFormat with an int8 layout), and x rounded by `round_activations_q8` (x_values (B, in)
    int8, x_scale (B, in / 32) float32, x_total (B, in / 32) int32); y (B, rows) float32. count is a
    literal: each call compiles that count's code alone, a switch on the kind around it."""

    @intrinsic(prefer_literal=True)
    def rows_by_16(typingctx, kind, count, addresses, x_values, x_scale, x_total, group, sample, y):
        stored_integer(kind)
        if not isinstance(count, types.IntegerLiteral):
            raise TypeError(f"an int8 group's count is a literal integer, not {count}")
        stored_addresses(addresses)
        qdot_check(x_values, x_scale, x_total, y)
        samples = count.literal_value

        def codegen(context, builder, signature, args):
            stored_kinds(builder, args[0], formats,
                         lambda _, format: qdot_int8_group(context, builder, signature, args, format, samples))
            return context.get_dummy_value()

        return types.none(kind, count, addresses, x_values, x_scale, x_total, group, sample, y), codegen

    return rows_by_16


# an int8 group's weights are put rows by 16 once per 8 rows of x (then 4, then 1): each row's
# integer products are a few instructions, so the unpacking is a larger share than in the float
# products (SmolLM2, 8 sequences: 10.0 ms a step against 11.9 with 4 at a time; 2026-12-04)
QDOT_INT8_SAMPLES = 8


# the bits of |x| for float32 x (sign cleared), and the least such bits of an infinity or a NaN:
# for finite values, the bits of |x| as int32 order as |x| does
F32_MAGNITUDE_BITS = 0x7FFFFFFF
F32_NON_FINITE_BITS = 0x7F800000
ROUNDING_LANES = 8


@njit(cache=True)
def round_activations_q8(x, x_values, x_scale, x_total):
    """Each row of x (B, in) float32, C-contiguous, rounded as llama.cpp's reference quantizer
    (quantize_row_q8_1_ref, and gguf's Q8_0) rounds it, per 32 values: scale d = max |x| / 127,
    the integers round(x * (1 / d)) (the product in float32, rounded half away from zero), and
    their sum; a block of zeros has d = 0. A block holding a NaN or an infinity gets d = NaN, so
    that its products are NaN as they are in float32.

    Written for LLVM to vectorize (2.6x faster than a scalar loop at SmolLM2's shapes): the
    block's largest |x| is the largest of their bits as integers, in 8 independent lanes (so
    the 32 compares are not one chain), which also finds a non-finite value; the rounding is in
    float32, exact: for |v| <= 127, v - floor(v) is exact, so comparing it with 0.5 rounds as
    floor(v + 0.5) in exact arithmetic would."""
    n_blocks = x.shape[1] // 32
    bits = x.view(np.int32)
    lanes = np.empty(ROUNDING_LANES, np.int32)
    largest_float = lanes[:1].view(np.float32)  # lanes[0]'s bits as the float32 they are
    for b in range(x.shape[0]):
        for block in range(n_blocks):
            start = 32 * block
            for k in range(ROUNDING_LANES):
                lanes[k] = bits[b, start + k] & F32_MAGNITUDE_BITS
            for i in range(start + ROUNDING_LANES, start + 32, ROUNDING_LANES):
                for k in range(ROUNDING_LANES):
                    lanes[k] = max(lanes[k], bits[b, i + k] & F32_MAGNITUDE_BITS)
            for k in range(1, ROUNDING_LANES):
                lanes[0] = max(lanes[0], lanes[k])
            if lanes[0] >= F32_NON_FINITE_BITS:
                x_values[b, start:start + 32] = 0
                x_scale[b, block] = np.float32(np.nan)
                x_total[b, block] = 0
                continue
            d = largest_float[0] / np.float32(127.0)
            inverse = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for i in range(start, start + 32):
                value = x[b, i] * inverse
                magnitude = abs(value)
                whole = np.floor(magnitude)
                rounded = whole + (np.float32(1.0) if magnitude - whole >= np.float32(0.5) else np.float32(0.0))
                q = np.int32(rounded if value >= 0 else -rounded)
                x_values[b, i] = q
                total += q
            x_scale[b, block] = d
            x_total[b, block] = total
