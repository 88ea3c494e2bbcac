"""The generated fused decode step (gen/<name>/decode_cpu.py) and its linear maps on int8
activations.

- The products on int8 activations (--activations q8_0, `linear_stored` on layers given int8 kinds
  by pyml.generate.stored_step.with_int8_activations, their rows read in place) equal the exact model's matVec (pyml/exact.py)
  bit for bit, with integers up to 127 that the rounding keeps exactly, also beside a layer that
  keeps float32 activations.
- The rounding of activations to int8 equals gguf's Q8_0 quantizer (llama.cpp's reference), and
  the int8-activation products on real weights equal gguf's dequantized weights times the rounded
  activations; the VNNI instruction and the generic vector code give the same bits.
- The whole step on llama_tiny with weights quantized to Q8_0, Q4_0 or Q4_1 gives, position after
  position, the logits of a float64 numpy forward over the whole sequence on the same (dequantized)
  weights, within float32 rounding.
Every kind of stored row on float32 activations, exact and real, is tests/kernels/test_stored_rows.py's;
the real models through the step (their greedy tokens equal to transformers') are in
test_shipped_generation.py.
"""

import importlib

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML

from pyml import exact
from pyml.errors import PymlError
from pyml.generate.quantized import QuantizedDecoder, check_weights
from pyml.generate.stored_step import with_int8_activations
from pyml.package import quantized_dot
from pyml.package.decode_cpu import INT8_LAYER_KIND_OF, linear_stored, row_addresses, stored_weight
from pyml.weight_formats import FORMATS
from tests.support.llama_tiny_reference import reference_logits
from tests.support.project_packages import project_package
from tests.support.quantized_cases import exact_weights, gguf_weights

tiny = project_package("llama_tiny").model
decode_cpu_step = importlib.import_module(project_package("llama_tiny").__name__ + ".decode_cpu")

# the formats --activations q8_0 runs
INT8_TYPES = tuple(GGML(int(t)) for t, f in FORMATS.items() if f.int8 is not None)


def stored_layers(layers, rows):
    """The stored form of layers given as (GGUF bytes, type) of `rows` rows each (the caller keeps
    the bytes)."""
    kinds = np.stack([np.full(rows, int(ggml)) for _, ggml in layers])
    return stored_weight(kinds, np.stack([row_addresses(raw, rows) for raw, _ in layers]))


def int8_step_weight(raw, ggml, rows, columns, int8_activations):
    weight = stored_layers([(raw, ggml)], rows)
    return with_int8_activations(weight) if int8_activations else weight


def exact_int8_input(rng, columns):
    """Integers in [-127, 127], each block of 32 holding a +-127: rounding to int8 keeps them
    (scale 127 / 127 = 1)."""
    x = rng.integers(-127, 128, (1, columns))
    x[0, ::32] = rng.choice([-127, 127], columns // 32)
    return x


# 37 rows: two whole groups of 16 rows and a last one of 5
@pytest.mark.parametrize("blocks", [1, 2, 3, 7])
@pytest.mark.parametrize("ggml", INT8_TYPES, ids=[t.name for t in INT8_TYPES])
def test_int8_activation_rows_equal_the_exact_mat_vec(ggml, blocks):
    rng = np.random.default_rng(blocks)
    rows, columns = 37, 32 * blocks
    raw, weights = exact_weights(ggml, rows, columns, rng)
    weight = int8_step_weight(raw, ggml, rows, columns, int8_activations=True)
    x = exact_int8_input(rng, columns)
    written = np.full((1, rows + 16), np.nan, np.float32)  # y, and what follows it in memory
    y = written[:, :rows]
    linear_stored(weight, 0, x.astype(np.float32), y)
    assert np.isnan(written[0, rows:]).all()  # the last group of 16 rows wrote only its 5
    assert np.array_equal(rounded(x.astype(np.float32))[0], x)  # the rounding keeps the integers
    expected = exact.mat_vec(weights.astype(np.int64).tolist(), x[0].tolist())
    assert np.array_equal(y[0], np.array(expected, dtype=np.float64))


def test_int8_layers_share_a_stack_with_float_activation_layers():
    """A Q4_1 layer on int8 activations beside a Q4_K layer, which keeps float32 activations (Q4_K
    has no int8 kind): both layers equal their exact matVec."""
    rng = np.random.default_rng(12)
    rows, columns = 37, 256
    layers = [(*exact_weights(ggml, rows, columns, rng), ggml) for ggml in (GGML.Q4_1, GGML.Q4_K)]
    weight = with_int8_activations(stored_layers([(raw, ggml) for raw, _, ggml in layers], rows))
    assert weight[2].tolist() == [INT8_LAYER_KIND_OF[int(GGML.Q4_1)], int(GGML.Q4_K)]
    # int8-exact activations for the Q4_1 layer; small ones for Q4_K, whose products are larger
    inputs = (exact_int8_input(rng, columns), rng.integers(-8, 9, (1, columns)))
    for layer, ((_, weights, _), x) in enumerate(zip(layers, inputs)):
        y = np.full((1, rows), np.nan, np.float32)
        linear_stored(weight, layer, x.astype(np.float32), y)
        expected = exact.mat_vec(weights.astype(np.int64).tolist(), x[0].tolist())
        assert np.array_equal(y[0], np.array(expected, dtype=np.float64))


def rounded(x):
    """round_activations_q8 of x (B, in): (values, scale, total)."""
    values = np.zeros(x.shape, np.int8)
    scale, total = (np.zeros((x.shape[0], x.shape[1] // 32), dtype) for dtype in (np.float32, np.int32))
    quantized_dot.round_activations_q8(x, values, scale, total)
    return values, scale, total


def test_activations_round_as_gguf_quantizes_q8_0():
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    x = rng.normal(0, 2, (1, 32 * 40)).astype(np.float32)
    x[0, 64:96] = 0  # a block of zeros: scale 0, values 0
    x[0, 96:128] = np.float32(0.5) * rng.integers(-9, 10, 32)
    # exact ties: the largest |x| 127 makes the scale 1, and each value is an integer and a half
    x[0, 128:160] = rng.integers(-127, 127, 32) + np.float32(0.5)
    x[0, 128] = 127
    values, scale, total = rounded(x)
    blocks = quantize(x, GGML.Q8_0).reshape(-1, 34)  # (float16 d, 32 int8) per block
    assert np.array_equal(values[0], blocks[:, 2:].view(np.int8).reshape(-1))
    assert np.array_equal(scale[0].astype(np.float16), blocks[:, :2].copy().view(np.float16)[:, 0])
    assert np.array_equal(total[0], values[0].reshape(-1, 32).astype(np.int64).sum(1))
    assert scale[0, 2] == 0 and not values[0, 64:96].any()


def test_a_non_finite_activation_makes_its_block_nan():
    x = np.ones((1, 96), np.float32)
    x[0, 40], x[0, 70] = np.nan, np.inf
    values, scale, total = rounded(x)
    assert scale[0, 0] == np.float32(1 / 127) and np.isnan(scale[0, 1:]).all()
    raw, _ = exact_weights(GGML.Q8_0, 2, 96, np.random.default_rng(0))
    weight = int8_step_weight(raw, GGML.Q8_0, 2, 96, int8_activations=True)
    y = np.zeros((1, 2), np.float32)
    linear_stored(weight, 0, x, y)
    assert np.isnan(y).all()


@pytest.mark.parametrize("ggml", INT8_TYPES, ids=[t.name for t in INT8_TYPES])
def test_int8_activation_rows_on_real_weights(ggml):
    """gguf's dequantization times the rounded activations, in float64, within the float32
    summation bound; the float32-activation row is 100 times further from it (the rounding ran)."""
    from tests.support.quantized_cases import UNIT, real_weights

    rng = np.random.default_rng(11)
    rows, columns = 40, 32 * 23  # two groups of 16 rows and a part
    raw = real_weights(ggml, rows, columns, rng)
    x = rng.normal(0, 1, (1, columns)).astype(np.float32)
    values, scale, _ = rounded(x)
    x_rounded = (values.astype(np.float64).reshape(-1, 32) * scale[0][:, None]).reshape(1, -1)
    weights = gguf_weights(raw, ggml, rows, columns).astype(np.float64)
    expected = x_rounded @ weights.T
    errors = {}
    for int8_activations in (True, False):
        y = np.full((1, rows), np.nan, np.float32)
        linear_stored(int8_step_weight(raw, ggml, rows, columns, int8_activations), 0, x, y)
        errors[int8_activations] = np.abs(y - expected)
    assert (errors[True] <= columns * UNIT * (np.abs(x_rounded) @ np.abs(weights.T))).all()
    assert errors[False].max() > 100 * errors[True].max()


VECTOR_IR_CHOICE = """
import numpy as np
from pyml.package import quantized_dot
from pyml.package.decode_cpu import linear_stored, row_addresses, stored_weight
from pyml.weight_formats import GGMLType, quantize
from pyml.generate.stored_step import with_int8_activations
rng = np.random.default_rng(5)
rows, columns = 21, 32 * 7
x = rng.normal(0, 1, (1, columns)).astype(np.float32)
bits = []
for ggml in (GGMLType.Q4_1, GGMLType.Q8_0):
    raw = quantize(rng.normal(0, 0.05, (rows, columns)).astype(np.float32), ggml).reshape(-1)
    weight = stored_weight(np.full((1, rows), int(ggml)), row_addresses(raw, rows)[None])
    weight = with_int8_activations(weight)
    y = np.zeros((1, rows), np.float32)
    linear_stored(weight, 0, x, y)
    bits.append(y.tobytes().hex())
print(quantized_dot.QDOT_VNNI, *bits)
"""


def test_vnni_and_generic_vector_code_give_the_same_bits():
    """The same products compiled for this CPU (VNNI where it has it) and for a generic x86-64."""
    import os
    import subprocess
    import sys

    if not quantized_dot.QDOT_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: the generic vector code is all that runs")
    outputs = {}
    for cpu in ("host", "x86-64"):
        env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_CPU")}
        if cpu != "host":
            env["NUMBA_CPU_NAME"] = cpu
        result = subprocess.run([sys.executable, "-c", VECTOR_IR_CHOICE], env=env, capture_output=True,
                                text=True, check=True)
        outputs[cpu] = result.stdout.split()
    assert outputs["host"][0] == "True" and outputs["x86-64"][0] == "False"
    assert outputs["host"][1:] == outputs["x86-64"][1:]


def dequantize_linear_weights(model, weights):
    """Replace each weight the step quantizes to `weights` by the dequantization of its blocks,
    so that a float forward on the model runs the weights the step runs."""
    from pyml.weight_formats import dequantize, quantize
    from pyml.generate.quantized import QUANTIZE_TO

    target, views = QUANTIZE_TO[weights], tiny.Model.tensors(model.params)
    for _, _, _, parts in decode_cpu_step.LINEARS:
        for layer in range(tiny.N_LAYERS):
            for pattern, _, _ in parts:
                view = views[pattern.format(l=layer)]
                view[...] = dequantize(quantize(view, target).reshape(-1), target, view.shape)


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "q4_1"])
def test_fused_step_logits_equal_a_numpy_forward(weights):
    rng = np.random.default_rng(0)
    model = tiny.Model()
    model.params.flat[:] = rng.normal(0, 0.3, model.params.flat.shape)
    decoder = QuantizedDecoder.of_model(model, weights)
    dequantize_linear_weights(model, weights)
    ids = rng.integers(0, tiny.VOCAB, 12).tolist()
    expected = reference_logits(model.params, ids)
    cache, logits = decoder.start_decoding(np.array([ids[:5]]), len(ids))
    scale = np.abs(expected).max()
    threads = numba.get_num_threads()
    for position in range(5, len(ids)):
        logits = decoder.decode(cache, np.array([ids[position]]))
        assert np.abs(logits[0] - expected[position]).max() < 1e-5 * scale
    # the step runs its small ops on one of the pool's threads, and gives the count back
    assert numba.get_num_threads() == threads


@pytest.mark.parametrize("weights", ["q8_0", "q4_1"])
def test_fused_step_on_int8_activations_stays_near_the_numpy_forward(weights):
    """--activations q8_0 on llama_tiny: within the rounding's error of the float64 forward, and
    not the float32-activation step's logits (the rounding ran on every op)."""
    rng = np.random.default_rng(0)
    model = tiny.Model()
    model.params.flat[:] = rng.normal(0, 0.3, model.params.flat.shape)
    float_decoder = QuantizedDecoder.of_model(model, weights)
    int8_decoder = QuantizedDecoder.of_model(model, weights, activations="q8_0")
    assert {int8_decoder.formats[prefix] for prefix, _, _, _ in decode_cpu_step.LINEARS} == {
        f"{weights.upper()} x Q8_0 activations"}
    dequantize_linear_weights(model, weights)
    ids = rng.integers(0, tiny.VOCAB, 12).tolist()
    expected = reference_logits(model.params, ids)
    scale = np.abs(expected).max()
    caches = [decoder.start_decoding(np.array([ids[:5]]), len(ids))[0]
              for decoder in (float_decoder, int8_decoder)]
    for position in range(5, len(ids)):
        float_logits, int8_logits = (decoder.decode(cache, np.array([ids[position]]))
                                     for decoder, cache in zip((float_decoder, int8_decoder), caches))
        assert np.abs(int8_logits[0] - expected[position]).max() < 3e-2 * scale
        assert np.abs(int8_logits[0] - float_logits[0]).max() > 1e-5 * scale


@pytest.mark.parametrize("weights, activations, message", [
    ("q4_1", "q4", "--activations must be one of f32, q8_0, not 'q4'"),
    ("f32", "q8_0", "--activations q8_0 rounds what quantized weights multiply: it needs --weights other than f32"),
])
def test_activations_the_step_cannot_run_are_refused_in_one_line(weights, activations, message):
    with pytest.raises(PymlError, match=message):
        check_weights(weights, activations)


def test_weights_the_fused_step_does_not_know_are_refused_in_one_line():
    with pytest.raises(PymlError, match="--weights must be one of as-stored, f32, q8_0, q4_0, q4_1, not 'Q4_1'"):
        check_weights("Q4_1")


# -- a batch of sequences (`pyml serve`): each sequence's bits do not depend on the batch ----------

# every format the step reads where it is stored
ROW_TYPES = tuple(GGML(int(t)) for t, f in FORMATS.items() if f.row_values is not None)


@pytest.mark.parametrize("ggml, int8", [*((t, False) for t in ROW_TYPES), *((t, True) for t in INT8_TYPES)],
                         ids=[t.name for t in ROW_TYPES] + [f"{t.name} x Q8_0" for t in INT8_TYPES])
def test_linear_stored_gives_each_row_the_bits_it_gets_alone(ggml, int8):
    """Thirteen rows of x at once (float activations: three groups of four and one left over;
    int8 ones: 8, 4 and 1) against each row alone, on a layer of one kind (its own loop): the same
    float32 bits, on inputs whose sums round (so a different summation order would show); 40
    output rows (int8: two whole groups of 16 and a part). Rows of mixed kinds:
    tests/kernels/test_stored_rows.py."""
    rng = np.random.default_rng(3)
    if ggml in (GGML.F32, GGML.F16, GGML.BF16):  # small integers: every float format holds them
        values = rng.integers(-8, 9, (40, 256)).astype(np.float32)
        raw = (np.ascontiguousarray(values).view("<u4") >> 16).astype("<u2") if ggml == GGML.BF16 else (
            values.astype("<f4" if ggml == GGML.F32 else "<f2"))
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    else:
        raw, _ = exact_weights(ggml, 40, 256, rng)
    weight = int8_step_weight(raw, ggml, 40, 256, int8)
    x = rng.normal(0, 1, (13, 256)).astype(np.float32)
    together = np.full((13, 40), np.nan, np.float32)
    linear_stored(weight, 0, x, together)
    for row in range(13):
        alone = np.full((1, 40), np.nan, np.float32)
        linear_stored(weight, 0, x[row : row + 1], alone)
        np.testing.assert_array_equal(together[row], alone[0])


@pytest.mark.parametrize("weights", ["q4_1", "q8_0", "float rows"])
def test_a_sequence_decodes_the_same_bits_in_any_batch(weights):
    """Five sequences of different prompts, decoded alone (start_decoding: the whole prompt in
    one step; decode) and in one DecodingBatch that they join and leave at different steps, in
    changing orders, their prompts prefilled 4 tokens per step beside the others' decoding: each
    one's logits are the same bits at every position."""
    from pyml.generate.quantized import DecodingBatch

    rng = np.random.default_rng(5)
    model = tiny.Model()
    model.params.flat[:] = rng.normal(0, 0.3, model.params.flat.shape)
    decoder = QuantizedDecoder.of_model(model, "as-stored" if weights == "float rows" else weights)
    prompts = [rng.integers(0, tiny.VOCAB, length).tolist() for length in (3, 7, 1, 12, 5)]
    tokens = [rng.integers(0, tiny.VOCAB, 10).tolist() for _ in prompts]
    alone = []
    for prompt, following in zip(prompts, tokens):
        cache, logits = decoder.start_decoding(np.array([prompt]), len(prompt) + len(following))
        alone.append([logits[0]] + [decoder.decode(cache, np.array([t]))[0] for t in following])
    batch = DecodingBatch(decoder, 4, 32, chunk=4)
    joins = [0, 0, 2, 3, 6]  # the step at which each sequence joins; at most 4 run at once
    rows, drawn, done, step = {}, {}, set(), 0
    while len(done) < len(prompts):
        for n, join in enumerate(joins):
            if join <= step and n not in rows and n not in done and batch.free:
                rows[n], drawn[n] = batch.add(prompts[n]), 0
        # the next token of each sequence past its prompt, in an order that changes every step
        running = sorted((n for n in rows if drawn[n]), reverse=step % 2 == 1)
        logits = batch.step({rows[n]: tokens[n][drawn[n] - 1] for n in running})
        by_row = {row: n for n, row in rows.items()}
        for row, row_logits in logits.items():
            n = by_row[row]
            np.testing.assert_array_equal(row_logits, alone[n][drawn[n]], err_msg=f"{n}")
            drawn[n] += 1
            if drawn[n] == len(tokens[n]) + 1:
                batch.release(rows.pop(n))
                done.add(n)
        step += 1


def test_a_prompt_longer_than_a_chunk_takes_several_steps_beside_the_others():
    """Chunked prefill: a 12-token prompt with chunk 4 gives its logits on the third step, while
    a decoding sequence gets its next logits at every step."""
    from pyml.generate.quantized import DecodingBatch

    model = tiny.Model()
    model.params.flat[:] = np.random.default_rng(6).normal(0, 0.3, model.params.flat.shape)
    batch = DecodingBatch(QuantizedDecoder.of_model(model), 3, 32, chunk=4, prefix_cache=False)
    short = batch.add([1, 2])
    assert list(batch.step({})) == [short]
    long = batch.add(list(range(1, 13)))
    for _ in range(2):
        assert list(batch.step({short: 3})) == [short]
    assert sorted(batch.step({short: 3})) == sorted([short, long])
    assert batch.lengths[long] == 12 and batch.lengths[short] == 5
    batch.release(long)
    # the chunk is shared, first come first served; a released row's prompt is dropped
    first, second = batch.add(list(range(1, 7))), batch.add(list(range(1, 7)))
    batch.step({short: 3})
    assert (batch.lengths[first], batch.lengths[second]) == (4, 0)
    batch.release(second)
    assert list(batch.step({})) == [first] and batch.lengths[second] == 0
    with pytest.raises(PymlError, match="the prompt has 0 tokens: a sequence takes 1 to 32"):
        batch.add([])


def test_the_steps_keep_the_buffers_of_a_few_sizes():
    """A server's steps have every size from 1 to the batch plus a chunk: the batch keeps the
    buffers of the last BUFFER_SHAPES sizes only, so its memory does not grow with them."""
    from pyml.generate.quantized import DecodingBatch
    from pyml.package.base import BUFFER_SHAPES

    # each prompt begins with the one before: the prefix cache would leave a one-entry step
    batch = DecodingBatch(QuantizedDecoder.of_model(tiny.Model()), 1, 32, chunk=32, prefix_cache=False)
    for length in range(1, 20):
        row = batch.add(list(range(1, length + 1)))
        batch.step({})
        batch.release(row)
    assert list(batch.steps) == list(range(20 - BUFFER_SHAPES, 20))


def test_prefills_of_every_length_keep_the_buffers_of_a_few():
    """The float32 model prefills (CUDA's decoding, pyml eval) at every length: the model keeps the
    buffers of the last BUFFER_SHAPES shapes only."""
    from pyml.package.base import BUFFER_SHAPES

    model = tiny.Model()
    for length in range(1, 20):
        model.start_decoding(np.array([list(range(1, length + 1))]), 32)
    assert list(model.buffers) == [(1, length, tiny.Model.N_LAYERS)
                                   for length in range(20 - BUFFER_SHAPES, 20)]
