"""The generated CUDA decode step (gen/<name>/decode_cuda.py) and its linear map, under Numba's
CUDA simulator or on a GPU (the switch of tests/support/cuda_target.py), in a child process of
tests/support/cuda_simulator.py:

- `linear_row` equals the exact model's matVec bit for bit in every format the step runs, on
  layers of two formats in one stack, and on a float64 model's dense rows (the cases of
  tests/support/quantized_cases.py, which the CPU step passes too);
- the whole step on llama_tiny on device="cuda", its weights quantized to Q4_1, gives position after
  position the logits of a float64 numpy forward on the same dequantized weights, within float32
  rounding, and the same logits as the CPU's fused step;
- the fuzz corpus' specs run through it in tests/cuda/fuzz_cuda_cases.py.
"""

# isort: off
from tests.support.cuda_target import check_target  # first: sets the target
# isort: on

import numpy as np
import pytest
from numba import cuda

from pyml.errors import PymlError
from pyml.generate.quantized import QuantizedDecoder
from pyml.package.decode_cuda import device_weight, linear_row
from tests.support.llama_tiny_reference import reference_logits
from tests.support.project_packages import project_package
from tests.support.quantized_cases import (
    STEP_TYPES,
    case_step_exact,
    case_step_float64_rows,
    case_step_two_kinds_in_one_stack,
)

tiny = project_package("llama_tiny").model


def test_the_target_asked_for_runs():
    check_target()


def run_cuda_step(weight, layer, x):
    y = cuda.to_device(np.full((1, weight[1].shape[1]), np.nan, x.dtype))
    linear_row(device_weight(weight), layer, cuda.to_device(x), y)
    return y.copy_to_host()


@pytest.mark.parametrize("ggml", [*STEP_TYPES, None], ids=[t.name for t in STEP_TYPES] + ["dense"])
def test_linear_row_equals_the_exact_mat_vec(ggml):
    case_step_exact(run_cuda_step, ggml)


def test_layers_of_two_kinds_share_one_stack():
    case_step_two_kinds_in_one_stack(run_cuda_step)


def test_linear_row_runs_float64_rows():
    case_step_float64_rows(run_cuda_step)


def test_cuda_step_logits_equal_a_numpy_forward_and_the_cpu_step():
    """Q4_1 (scales and offsets; the other formats' products are the cases above), two positions
    after a prompt of four: the simulator runs each of a token's 19,456 GPU threads in Python, a
    token in about 90 s here."""
    rng = np.random.default_rng(0)
    flat = rng.normal(0, 0.3, tiny.Model().params.flat.shape).astype(np.float32)
    models = {"cpu": tiny.Model(), "cuda": tiny.Model(device="cuda")}
    for model in models.values():
        model.device.to_device(flat, model.params.flat)
    decoders = {name: QuantizedDecoder.of_model(model, "q4_1") for name, model in models.items()}
    assert decoders["cuda"].step.__name__.endswith(".decode_cuda")
    gpu = models["cuda"]
    ids = rng.integers(0, tiny.VOCAB, 6).tolist()
    # the weights both steps run: the float32 model's, now the dequantization of their blocks
    expected = reference_logits(tiny.Parameters(gpu.device.to_host(gpu.params.flat)), ids)
    scale = np.abs(expected).max()
    caches = {name: decoder.start_decoding(np.array([ids[:4]]), len(ids))[0]
              for name, decoder in decoders.items()}
    for position in range(4, len(ids)):
        logits = {name: decoder.decode(caches[name], np.array([ids[position]]))
                  for name, decoder in decoders.items()}
        assert np.abs(logits["cuda"][0] - expected[position]).max() < 1e-5 * scale
        assert np.abs(logits["cuda"][0] - logits["cpu"][0]).max() < 1e-5 * scale


def test_int8_activations_are_refused_in_one_line():
    model = tiny.Model(device="cuda")
    with pytest.raises(PymlError, match="--activations q8_0 runs on the CPU only"):
        QuantizedDecoder.of_model(model, "q8_0", activations="q8_0")
