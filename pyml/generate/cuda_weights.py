"""The CUDA decode step's weights (pyml/package/decode_cuda.py): each op's layers stacked as the
arrays pyml/formats/gguf_quantized.py splits a GGUF's blocks into (packed integers, float32
scales and offsets) or as float rows, copied to the device by `device_weight`. The float32 model,
which prefills the prompt on CUDA, is loaded beside them.

    as-stored  the GGUF's quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K, also mixed
               across layers where their packed values have one width); an op with a tensor of
               another type, or whose parts differ in type within a layer, runs on float32 rows.
               A folder without a GGUF stores float32: its rows are the model's.
    q8_0, q4_0, q4_1  every linear weight quantized from the float32 weights by llama.cpp's
               reference quantizer; the float32 model's weights are replaced by their
               dequantization, so that its prefill runs the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.gguf_quantized import quantized_matrix
from pyml.weight_formats import GGMLType, dequantize, quantize
from pyml.package.decode_cuda import DENSE, Q4_RUNS_OF_16, Q4_RUNS_OF_32, Q5, Q6, Q8

# the fused step's kind (pyml/package/decode_cpu.py) of each type kept quantized
STEP_KINDS = {GGMLType.Q4_0: Q4_RUNS_OF_16, GGMLType.Q4_1: Q4_RUNS_OF_16,
              GGMLType.Q4_K: Q4_RUNS_OF_32, GGMLType.Q5_0: Q5, GGMLType.Q8_0: Q8,
              GGMLType.Q6_K: Q6}
# bytes of packed values per weight: layers of one op may differ in type where this agrees
PACKED_PER_VALUE = {GGMLType.Q4_0: 0.5, GGMLType.Q4_1: 0.5, GGMLType.Q4_K: 0.5, GGMLType.Q5_0: 0.5,
                    GGMLType.Q6_K: 0.5, GGMLType.Q8_0: 1}

def weight_tuple(kinds: list[int], layers: list[dict[str, np.ndarray]], rows: int) -> tuple:
    """The step's (kinds, packed, high, scale, offset, dense): the kind of each layer, each array
    stacked (layers, rows, width), as wide as its widest layer (pyml/package/decode_cpu.py says
    why the padding is never read), width 0 where no layer has it. Dense rows keep the model's
    dtype."""
    arrays = []
    for name in ("packed", "high", "scale", "offset", "dense"):
        present = [layer[name] for layer in layers if name in layer]
        raw = name in ("packed", "high")
        dtype = np.uint8 if raw else present[0].dtype if present else np.float32
        width = max((array.shape[1] * array.dtype.itemsize // np.dtype(dtype).itemsize
                     for array in present), default=0)
        stacked = np.zeros((len(layers), rows, width), dtype)
        for index, layer in enumerate(layers):
            if name in layer:
                array = layer[name].view(np.uint8) if raw else layer[name]
                stacked[index, :, :array.shape[1]] = array
        arrays.append(stacked)
    return (np.array(kinds, np.int64), *arrays)


def float_rows(model, param) -> tuple:
    """A weight parameter as the step's float rows: the values the folder holds, read without BLAS."""
    matrices = [model.device.to_host(matrix) for matrix in layer_weights(param)]
    return weight_tuple([DENSE] * len(matrices), [{"dense": matrix} for matrix in matrices],
                        len(matrices[0]))


def float_row_weights(model, linears) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight as float rows in the model's dtype, with each op's format."""
    weights = {prefix: float_rows(model, getattr(model.params, attr)) for prefix, attr, _, _ in linears}
    return weights, {prefix: np.dtype(model.params.flat.dtype).name.upper() for prefix in weights}


def kept_arrays(ggml_type: GGMLType, arrays: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
    """gguf_quantized's arrays of a matrix under the step's names."""
    if ggml_type == GGMLType.Q8_0:
        return {"packed": arrays[0], "scale": arrays[1]}
    if ggml_type == GGMLType.Q6_K:
        return dict(zip(("packed", "high", "scale"), arrays))
    if ggml_type == GGMLType.Q5_0:
        return dict(zip(("packed", "high", "scale", "offset"), arrays))
    return dict(zip(("packed", "scale", "offset"), arrays))


def layer_weights(param) -> list[np.ndarray]:
    """A weight parameter's matrix per layer: a per-layer parameter is a list of views."""
    return list(param) if isinstance(param, list) else [param]


def requantized_weights(model, linears, target: GGMLType) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight quantized to `target`, and the float32 model's weights replaced by the
    dequantization of those blocks (so the prefill runs the same weights); with each op's format."""
    weights = {}
    for prefix, attr, _, _ in linears:
        layers = []
        for weight in layer_weights(getattr(model.params, attr)):
            rows, columns = weight.shape
            if columns % 32:
                raise PymlError(f"{attr}: rows of {columns} values are not whole {target.name} "
                                "blocks of 32; use --weights f32")
            raw = quantize(model.device.to_host(weight), target).reshape(-1)
            model.device.to_device(dequantize(raw, target, (rows, columns)), weight)
            layers.append(kept_arrays(target, quantized_matrix(raw, int(target), (rows, columns)).arrays))
        weights[prefix] = weight_tuple([STEP_KINDS[target]] * len(layers), layers, rows)
    return weights, {prefix: target.name for prefix in weights}


def stored_weights(model, linears, gguf_path: Path) -> tuple[dict[str, tuple], dict[str, str]]:
    """Every linear weight as the GGUF stores it where one kept type covers all its parts and
    layers, else as float32 rows (the folder's weights, the same values); with each op's format."""
    from pyml.formats.gguf_architectures import architecture_of
    from pyml.formats.gguf_read import read_gguf

    gguf = read_gguf(gguf_path)
    architecture = architecture_of(gguf)
    derived = architecture.derived_tensors()  # rope_freqs.weight: no weight of the model
    gguf_names = {architecture.hf_name(name): name for name in gguf.tensors if name not in derived}
    weights, formats = {}, {}
    for prefix, attr, _, tensors in linears:
        param = getattr(model.params, attr)
        per_layer = isinstance(param, list)
        sources = [[gguf_names.get(name.format(l=l) if per_layer else name) for name, _, _ in tensors]
                   for l in range(len(layer_weights(param)))]
        # one kept type per layer (all its parts), and one packed width for all layers
        types = [{gguf.tensors[name].ggml_type if name else None for name in names} for names in sources]
        if (any(len(kinds) != 1 or next(iter(kinds)) not in STEP_KINDS for kinds in types)
                or len({PACKED_PER_VALUE[next(iter(kinds))] for kinds in types}) != 1):
            weights[prefix], formats[prefix] = float_rows(model, param), "F32"
            continue
        layer_types = [next(iter(kinds)) for kinds in types]
        layers = []
        for names, ggml_type in zip(sources, layer_types):
            parts = []
            for name, (_, first, last) in zip(names, tensors):
                tensor = gguf.tensors[name]
                if tensor.shape != (last - first, layer_weights(param)[0].shape[1]):
                    raise PymlError(f"{gguf_path}: tensor {name!r} of shape {tensor.shape} is not "
                                    f"the folder's {attr} rows {first}:{last}; import the GGUF again")
                matrix = quantized_matrix(np.asarray(tensor.data), int(ggml_type), tensor.shape)
                # the row order the import gave the float32 weight (llama's rotary q and k rows)
                order = architecture.hf_weight(name, np.arange(tensor.shape[0])[:, None])[:, 0]
                parts.append(matrix.rows(order).arrays)
            layers.append(kept_arrays(ggml_type, tuple(np.concatenate(arrays) for arrays in zip(*parts))))
        weights[prefix] = weight_tuple([STEP_KINDS[t] for t in layer_types], layers, len(layers[0]["packed"]))
        formats[prefix] = "/".join(sorted({t.name for t in layer_types}))
    return weights, formats
