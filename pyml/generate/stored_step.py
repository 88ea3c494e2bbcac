"""What the CPU decode step (gen/<name>/decode_cpu.py) runs on, read from where the weights are
stored: no float32 model is built.

The step's linear maps and embeddings read each weight row in place, by address
(`pyml.package.decode_cpu.linear_stored`, `embedding_stored`): in a memory map of the folder's
GGUF or safetensors file, in the format the file stores it. So generating from a folder costs
about the file's size in memory, as llama.cpp does. The step's other parameters (norm gains,
biases: a few thousand values a layer) are read into small arrays (`StepModel`).

A tensor the kernels cannot read in place (a type they do not take: Q5_1, Q2_K, Q3_K, Q5_K) is
dequantized to float32 rows, that tensor only. `--weights q8_0/q4_0/q4_1` quantize each tensor in
turn (llama.cpp's reference quantizer) and keep the quantized bytes; `--activations q8_0` repacks
the Q4_0, Q4_1 and Q8_0 layers rows by 16 (a copy of those layers: pyml/package/quantized_dot.py
says why it is faster).
"""

from __future__ import annotations

import ctypes
from types import ModuleType, SimpleNamespace

import numpy as np

from pyml.errors import PymlError
from pyml.formats.gguf_quantized import quantized_matrix
from pyml.formats.quant import BLOCK_LAYOUT, GGMLType
from pyml.formats.quantize import quantize
from pyml.formats.stored_tensors import StoredTensor
from pyml.package.base import DecoderModel, Device, device_rope_tables
from pyml.package.decode_cpu import (
    Q4_RUNS_OF_16_X8,
    Q8_X8,
    ROW_KIND_OF,
    layer_kinds_of,
    stored_weight,
)
from pyml.package.quantized_dot import QDOT_GROUP_ROWS

# the types whose layers run on int8 activations under --activations q8_0, and their kind there
INT8_ACTIVATION_KINDS = {GGMLType.Q4_0: Q4_RUNS_OF_16_X8, GGMLType.Q4_1: Q4_RUNS_OF_16_X8,
                         GGMLType.Q8_0: Q8_X8}


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
    """A generated package's Model's parameters (float32 or float64) as stored tensors: each a
    view of the model's own buffer, so the step reads the model's values in place."""
    float_type = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float64): GGMLType.F64}
    host = model.host_tensors() if model.device.name != "cpu" else model.tensors(model.params)
    return {name: StoredTensor(name, float_type[array.dtype], tuple(array.shape),
                               np.ascontiguousarray(array).reshape(-1).view(np.uint8), None)
            for name, array in host.items()}


def step_parameters(step: ModuleType, tensors: dict[str, StoredTensor], n_layers: int,
                    dtype=np.float32) -> dict:
    """The step's PARAMETERS from `tensors`, in `dtype`: a fused one's parts stacked in order."""
    parameters = {}
    for attr, per_layer, parts in step.PARAMETERS:
        layers = [np.concatenate([tensor_of(tensors, name, l).dense(dtype) for name, _, _ in parts])
                  for l in range(n_layers if per_layer else 1)]
        parameters[attr] = layers if per_layer else layers[0]
    return parameters


def tensor_of(tensors: dict[str, StoredTensor], pattern: str, layer: int) -> StoredTensor:
    name = pattern.format(l=layer)
    if name not in tensors:
        raise PymlError(f"the weights hold no tensor {name!r}, which the step reads")
    return tensors[name]


def read_in_place(tensor: StoredTensor) -> StoredTensor:
    """`tensor` as the kernels can read it: itself, or its float32 rows where they take no rows of
    its type."""
    if tensor.ggml_type in ROW_KIND_OF:
        return tensor
    rows = np.ascontiguousarray(tensor.dense(np.float32))
    return StoredTensor(tensor.name, GGMLType.F32, rows.shape, rows.reshape(-1).view(np.uint8), None)


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
    per_layer = "{l}" in parts[0][0]
    layers = n_layers if per_layer else 1
    rows = parts[-1][2]
    kinds = np.zeros((layers, rows), np.uint8)
    addresses = np.zeros((layers, rows), np.uint64)
    formats, columns = set(), None
    for layer in range(layers):
        for pattern, first, last in parts:
            tensor = tensor_of(tensors, pattern, layer)
            if len(tensor.shape) != 2 or tensor.shape[0] != last - first or (
                    columns is not None and tensor.shape[1] != columns):
                raise PymlError(f"{tensor.name} has shape {tensor.shape}, not the step's "
                                f"{(last - first, columns or '?')}")
            columns = tensor.shape[1]
            tensor = quantized_to(tensor, target) if target is not None else read_in_place(tensor)
            weights.kept.append(tensor.data)
            order = tensor.row_order if tensor.row_order is not None else np.arange(last - first)
            kinds[layer, first:last] = ROW_KIND_OF[tensor.ggml_type]
            addresses[layer, first:last] = (np.uint64(tensor.data.ctypes.data)
                                            + order.astype(np.uint64) * np.uint64(tensor.row_bytes))
            formats.add(tensor.ggml_type.name)
    return stored_weight(kinds, addresses), formats


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


def row_bytes_at(address: int, count: int) -> np.ndarray:
    """The `count` bytes at `address` (a row the step reads), as a read-only view."""
    view = np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))
    view.flags.writeable = False
    return view


def rows_by_16(array: np.ndarray, per_block: int) -> np.ndarray:
    """A layer's (rows, width) array in quantized_dot's rows-by-16 order, flat per group of 16 rows
    (rows padded with zeros to a multiple of 16): per block of `per_block` elements of a row (16
    bytes of 4-bit values, 32 of 8-bit ones, or 1 scale), its runs of 4 bytes (of a scale: the
    scale), each run the 16 rows' in turn. (groups, 16 * width)."""
    rows, width = array.shape
    groups = -(-rows // QDOT_GROUP_ROWS)
    padded = np.zeros((groups * QDOT_GROUP_ROWS, width), array.dtype)
    padded[:rows] = array
    run = 4 if per_block > 1 else 1
    split = padded.reshape(groups, QDOT_GROUP_ROWS, width // per_block, per_block // run, run)
    return np.ascontiguousarray(split.transpose(0, 2, 3, 1, 4)).reshape(groups, -1)


def with_int8_activations(weight: tuple, columns: int) -> tuple:
    """`weight` (rows of `columns` values) with each layer whose rows are all Q4_0, all Q4_1 or all
    Q8_0 multiplying int8-rounded activations: its values, scales and offsets repacked rows by 16,
    the scales and offsets as float16 (the GGUF's own precision, so the bytes a token reads are
    the GGUF's), in arrays whose rows are padded to a multiple of 16 (pyml/package/decode_cpu.py
    gives the layout); the other layers stay as they are."""
    kinds, addresses, *_ = weight
    in_place = {kind: ggml_type for ggml_type, kind in ROW_KIND_OF.items()}
    layers, rows = kinds.shape
    padded_rows = -(-rows // QDOT_GROUP_ROWS) * QDOT_GROUP_ROWS
    repacked = {}
    for layer in range(layers):
        ggml_types = {in_place.get(int(kind)) for kind in np.unique(kinds[layer])}
        if len(ggml_types) == 1 and next(iter(ggml_types)) in INT8_ACTIVATION_KINDS:
            ggml_type = next(iter(ggml_types))
            row_size = quantized_row_bytes(ggml_type, columns)
            raw = np.concatenate([row_bytes_at(int(address), row_size) for address in addresses[layer]])
            repacked[layer] = (ggml_type, quantized_matrix(raw, int(ggml_type), (rows, columns)).arrays)
    if not repacked:
        return weight
    repacked_types = {ggml_type for ggml_type, _ in repacked.values()}
    four_bit = repacked_types != {GGMLType.Q8_0}
    # a 4-bit layer's values take columns / 2 bytes a row, a Q8_0 layer's columns
    packed = np.zeros((layers, padded_rows, columns if GGMLType.Q8_0 in repacked_types else columns // 2),
                      np.uint8)
    scale = np.zeros((layers, padded_rows, -(-(columns // 32) // 2)), np.float32)
    offset = np.zeros_like(scale) if four_bit else np.zeros((layers, padded_rows, 0), np.float32)
    new_kinds = kinds.copy()
    for layer, (ggml_type, arrays) in repacked.items():
        new_kinds[layer] = INT8_ACTIVATION_KINDS[ggml_type]
        q8 = ggml_type == GGMLType.Q8_0
        values = arrays[0].view(np.uint8)
        targets = [(packed, values, 32 if q8 else 16), (scale, arrays[1], 1)]
        if not q8:
            targets.append((offset, arrays[2], 1))
        for stack, source, per_block in targets:
            groups = stack[layer].reshape(padded_rows // QDOT_GROUP_ROWS, -1)
            order = rows_by_16(source, per_block)
            if per_block == 1:
                with np.errstate(over="ignore"):  # an overflow is refused just below
                    halves = order.astype(np.float16)
                if not np.array_equal(halves.astype(np.float32), order, equal_nan=True):
                    raise PymlError("a Q4_0, Q4_1 or Q8_0 block's scale or offset is not a float16 "
                                    "value (out of its range): leave out --activations q8_0")
                groups, order = groups.view(np.float16), halves
            groups[:, :order.shape[1]] = order
    return (new_kinds, addresses, layer_kinds_of(new_kinds), packed, scale, offset)


def quantized_row_bytes(ggml_type: GGMLType, columns: int) -> int:
    values_per_block, bytes_per_block = BLOCK_LAYOUT[ggml_type]
    return columns // values_per_block * bytes_per_block
