"""What the CPU decode step (gen/<name>/decode_cpu.py) runs on, read from where the weights are
stored: no float32 model is built.

The step's linear maps and embeddings read each weight row in place, by address
(`pyml.package.decode_cpu.linear_stored`, `embedding_stored`): in a memory map of the folder's
GGUF or safetensors file, in the format the file stores it. So generating from a folder costs
about the file's size in memory, as llama.cpp does. The step's other parameters (norm gains,
biases: a few thousand values a layer) are read into small arrays (`StepModel`).

A tensor the kernels cannot read in place (a type they do not take: Q5_1, Q2_K, Q3_K) is
dequantized to float32 rows, that tensor only. `--weights q8_0/q4_0/q4_1` quantize each tensor in
turn (llama.cpp's reference quantizer) and keep the quantized bytes; `--activations q8_0` runs the
Q4_0, Q4_1 and Q8_0 layers on int8-rounded activations, their rows read where they are stored as
every other layer's (no copy: pyml/package/quantized_dot.py says how).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import numpy as np

from pyml.errors import PymlError
from pyml.weight_formats import GGMLType, quantize
from pyml.formats.stored_tensors import StoredTensor
from pyml.package.base import DecoderModel, Device, device_rope_tables
from pyml.package.decode_cpu import INT8_LAYER_KIND_OF
from pyml.package.stored_rows import read_in_place, stored_rows, tensor_of


class StepModel:
    """What the step reads besides its weights: the package's PARAMETERS as small arrays (a
    per-layer one as a list, one array per layer), its RoPE tables, its one-position buffers
    (`DecodeBuffers`); on the CPU, in `dtype` (float32; float64 for the float64 models of the
    conformance tests, whose rows are F64)."""

    def __init__(self, package: ModuleType, parameters: dict, dtype=np.float32):
        model = package.Model
        self.package, self.SPEC_NAME = package, model.SPEC_NAME
        self.MAX_SEQ_LEN, self.ATTENTIONS, self.VOCAB = model.MAX_SEQ_LEN, model.ATTENTIONS, model.VOCAB
        self.DecodeBuffers = model.DecodeBuffers
        self.device = Device("cpu", dtype, model.kernels_cpu, model.kernels_cuda)
        self.params = SimpleNamespace(**parameters)
        self.rope = device_rope_tables(model.ROPE_TABLES, model.MAX_SEQ_LEN, self.device)

    load_batch = DecoderModel.load_batch


class StepWeights:
    """The step's weight tuples (`weights[prefix]`), the format of each op (e.g. "Q4_K/Q6_K"), and
    every array their addresses point into (memory maps, and the rows made here), which must live
    as long as the tuples."""

    def __init__(self):
        self.weights: dict[str, tuple] = {}
        self.formats: dict[str, str] = {}
        self.kept: list[np.ndarray] = []


def model_tensors(model) -> dict[str, StoredTensor]:
    """A generated package's CPU Model's parameters (float32 or float64) as stored tensors: each
    a view of the model's own buffer (a tensor is a contiguous slice of it), so the step reads the
    model's values in place."""
    float_type = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float64): GGMLType.F64}
    return {name: StoredTensor(name, float_type[array.dtype], tuple(array.shape),
                               np.ascontiguousarray(array).reshape(-1).view(np.uint8), None)
            for name, array in model.tensors(model.params).items()}


def step_parameters(step: ModuleType, tensors: dict[str, StoredTensor], n_layers: int,
                    dtype=np.float32) -> dict:
    """The step's PARAMETERS from `tensors`, in `dtype`: a fused one's parts stacked in order."""
    parameters = {}
    for attr, per_layer, parts in step.PARAMETERS:
        layers = [np.concatenate([tensor_of(tensors, name, l).dense(dtype) for name, _, _ in parts])
                  for l in range(n_layers if per_layer else 1)]
        parameters[attr] = layers if per_layer else layers[0]
    return parameters


def quantized_to(tensor: StoredTensor, target: GGMLType) -> StoredTensor:
    """`tensor` quantized to `target` by llama.cpp's reference quantizer."""
    rows, columns = tensor.shape
    if columns % 32:
        raise PymlError(f"{tensor.name}: rows of {columns} values are not whole {target.name} "
                        "blocks of 32; use --weights as-stored or f32")
    raw = quantize(tensor.dense(np.float32), target).reshape(-1)
    return StoredTensor(tensor.name, target, tensor.shape, raw, None)


def op_weight(tensors: dict[str, StoredTensor], parts: tuple, n_layers: int, weights: StepWeights,
              target: GGMLType | None) -> tuple[tuple, set[str]]:
    """One op's weight tuple over `parts` ((tensor name, first row, last row + 1), "{l}" the
    layer), its layers' rows read where they are stored (quantized to `target` first, if given);
    and the formats it holds."""
    prepare = read_in_place if target is None else (lambda tensor: quantized_to(tensor, target))
    return stored_rows(tensors, parts, n_layers, weights.kept, prepare)


def step_weights(step: ModuleType, tensors: dict[str, StoredTensor], n_layers: int,
                 target: GGMLType | None = None) -> StepWeights:
    """Every LINEARS and EMBEDDINGS weight of the step, quantized to `target` first if given (an
    embedding of its own stays as stored: it reads one row per token). Ops over the same tensors
    (a tied LM head and the embedding) share one tuple."""
    weights, shared = StepWeights(), {}
    ops = ([(prefix, parts, target) for prefix, _, _, parts in step.LINEARS]
           + [(prefix, parts, None) for prefix, _, parts in step.EMBEDDINGS])
    for prefix, parts, op_target in ops:
        if parts not in shared:
            shared[parts] = op_weight(tensors, parts, n_layers, weights, op_target)
        weights.weights[prefix], formats = shared[parts]
        weights.formats[prefix] = "/".join(sorted(formats))
    return weights


def with_int8_activations(weight: tuple) -> tuple:
    """`weight` with each layer whose rows are all Q4_0, all Q4_1 or all Q8_0 multiplying
    int8-rounded activations (its layer kind INT8_LAYER | its type: pyml/package/decode_cpu.py);
    the rows stay where they are stored, and the other layers as they are."""
    kinds, addresses, layer_kinds, down, up = weight
    int8_kinds = np.array([INT8_LAYER_KIND_OF.get(int(kind), kind) for kind in layer_kinds], np.uint8)
    return kinds, addresses, int8_kinds, down, up
