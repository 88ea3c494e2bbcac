"""Weights read where a model folder stores them, in the form the kernels take them: each row's
kind and address in the folder's memory map (the stored form, pyml/package/decode_cpu.py's
docstring), made from the folder's tensors (`pyml.formats.stored_tensors.StoredFolder`).

Two users: the fused decode step (pyml/generate/stored_step.py), and a LoRA model's frozen linear
maps (QLoRA: `StoredMaps`), which train adapters over a base kept as the file stores it, so that
fine-tuning costs about the file's size in memory, not a float32 copy of it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pyml.errors import PymlError
from pyml.weight_formats import GGMLType
from pyml.formats.stored_tensors import StoredTensor
from pyml.package.decode_cpu import READ_IN_PLACE, ROW_KINDS, stored_weight


def tensor_of(tensors: dict[str, StoredTensor], pattern: str, layer: int) -> StoredTensor:
    name = pattern.format(l=layer)
    if name not in tensors:
        raise PymlError(f"the weights hold no tensor {name!r}, which the model reads")
    return tensors[name]


def read_in_place(tensor: StoredTensor) -> StoredTensor:
    """`tensor` as the kernels can read it: itself, or its float32 rows where they take no rows of
    its type (Q5_1, Q2_K, Q3_K: that tensor alone is then a float32 copy)."""
    if tensor.ggml_type in READ_IN_PLACE:
        return tensor
    rows = np.ascontiguousarray(tensor.dense(np.float32))
    return StoredTensor(tensor.name, GGMLType.F32, rows.shape, rows.reshape(-1).view(np.uint8), None)


def stored_rows(tensors: dict[str, StoredTensor], parts: tuple, n_layers: int, kept: list,
                prepare: Callable[[StoredTensor], StoredTensor] = read_in_place) -> tuple[tuple, set[str]]:
    """The stored form (kinds, addresses, layer_kinds) of a weight made of `parts` ((tensor name,
    first row, last row + 1), "{l}" the layer), each tensor passed through `prepare` first; and
    the formats it holds. Every array the addresses point into is appended to `kept`, which must
    outlive the stored form."""
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
                raise PymlError(f"{tensor.name} has shape {tensor.shape}, not the model's "
                                f"{(last - first, columns or '?')}")
            columns = tensor.shape[1]
            tensor = prepare(tensor)
            kept.append(tensor.data)
            order = tensor.row_order if tensor.row_order is not None else np.arange(last - first)
            kinds[layer, first:last] = tensor.ggml_type
            addresses[layer, first:last] = (np.uint64(tensor.data.ctypes.data)
                                            + order.astype(np.uint64) * np.uint64(tensor.row_bytes))
            formats.add(tensor.ggml_type.name)
    return stored_weight(kinds, addresses), formats


def read_as_stored(tensor: StoredTensor) -> StoredTensor:
    """`tensor`, whose type the kernels must read where it is stored: a LoRA run over a stored base
    refuses a type they do not take rather than hold a float32 copy of it unasked."""
    if tensor.ggml_type not in READ_IN_PLACE:
        taken = ", ".join(GGMLType(kind).name for kind in sorted(ROW_KINDS))
        raise PymlError(f"{tensor.name} is stored {tensor.ggml_type.name}, which LoRA over the base as "
                        f"stored does not read (it reads {taken}); convert the GGUF first, e.g. `pyml "
                        "export-gguf FOLDER --out FILE --type q4_k_m` and `pyml import-gguf FILE`")
    return tensor


class StoredRows:
    """One layer's matrix (rows, columns) of a frozen linear map, read where it is stored: layer
    `layer` of the stored form `weight`. The frozen linear kernels (pyml/package/cpu/frozen_linear.py)
    take it where they take a float matrix; `dtype` is the model's (float32, or float64 for the
    reference tests), the dtype its tiles are dequantized to."""

    ndim = 2

    def __init__(self, weight: tuple, layer: int, shape: tuple, dtype, formats: str):
        self.weight, self.layer, self.shape = weight, layer, tuple(shape)
        self.dtype, self.formats = np.dtype(dtype), formats

    def __repr__(self) -> str:
        return f"StoredRows({self.formats}, layer {self.layer}, {self.shape})"


class StoredMaps:
    """The frozen linear maps of a LoRA model over a base kept as its folder stores it (QLoRA):
    for each map's weight attribute (the generated `Parameters.MAPS`: its parts in tensor files),
    one `StoredRows` per layer, read from `tensors` (a `StoredFolder`'s) in place. `kept` holds
    the memory maps (and any float32 rows made of a type the kernels do not take) alive."""

    def __init__(self, tensors: dict[str, StoredTensor], maps: dict[str, tuple], n_layers: int,
                 dtype):
        self.dtype, self.kept = np.dtype(dtype), []
        self.weights, self.formats, self.columns = {}, {}, {}
        for attr, parts in maps.items():
            self.weights[attr], formats = stored_rows(tensors, parts, n_layers, self.kept, read_as_stored)
            self.formats[attr] = "/".join(sorted(formats))
            self.columns[attr] = tensor_of(tensors, parts[0][0], 0).shape[1]

    def layer_rows(self, attr: str, shape: tuple) -> list[StoredRows]:
        """The map `attr`'s matrix of each layer; `shape` is the model's, checked."""
        weight = self.weights[attr]
        kinds, columns = weight[0], self.columns[attr]
        if (kinds.shape[1], columns) != tuple(shape):
            raise PymlError(f"the base's {attr} weight is {(kinds.shape[1], columns)}, the model's "
                            f"{tuple(shape)}")
        return [StoredRows(weight, layer, shape, self.dtype, self.formats[attr])
                for layer in range(kinds.shape[0])]
