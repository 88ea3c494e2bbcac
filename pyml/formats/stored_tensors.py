"""The weights of a model folder as they are stored, read by memory map, under Hugging Face names.

A folder keeps its weights in the form they came, in one of (first found wins):

    source.gguf                     an imported GGUF (a symbolic link to it, or a copy): quantized
                                    rows, F16, BF16 or F32, under llama.cpp's names and row order
    model.safetensors               Hugging Face's single file (F32, F16, BF16; F64 for the
                                    float64 checkpoints of the reference tests)
    model.safetensors.index.json    Hugging Face's sharded layout: {"weight_map": {name: shard}}
                                    beside the shards it names

Nothing is decoded here until someone asks (`StoredTensor.dense`): a tensor's `data` is a view of
the file's memory map, so a 1.4 GiB Q8_0 model costs the pages that are read, not a 5 GiB float32
copy. A numpy view keeps its map alive, so the maps live as long as any tensor's data is held.
Everything is validated before `StoredFolder` returns: a missing or moved file, a truncated one, an
index naming a missing shard or a dtype that holds no weights fail with one `PymlError` line.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from math import prod
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import Llama, architecture_of
from pyml.formats.gguf_import import check_tensors
from pyml.formats.gguf_read import read_gguf
from pyml.formats.model_folder import INDEX_FILE, MODEL_FILE, SOURCE_GGUF
from pyml.weight_formats import GGMLType, dequantize
from pyml.formats.safetensors_io import read_header, read_safetensors

# safetensors dtype -> (the GGML type of the same encoding, bytes per value); any other dtype
# holds no weights
SAFETENSORS_TYPES = {
    "F32": (GGMLType.F32, 4),
    "F16": (GGMLType.F16, 2),
    "BF16": (GGMLType.BF16, 2),
    "F64": (GGMLType.F64, 8),
}


@dataclass(frozen=True)
class StoredTensor:
    """One weight as its file stores it."""

    name: str  # the Hugging Face name
    ggml_type: GGMLType  # its encoding: F32, F16, BF16, F64 or a quantized type
    shape: tuple[int, ...]  # the Hugging Face shape, numpy order (fastest dimension last)
    # the stored bytes, uint8, 1-D: a read-only view of the file's memory map, rows in the file's
    # order
    data: np.ndarray
    # Hugging Face row i is stored row row_order[i] (a llama GGUF stores its Q and K rows
    # permuted, see gguf_architectures.unpermute_rotary_rows); None: the same order
    row_order: np.ndarray | None = None
    # turns the decoded float32 values, in the file's row order, into the Hugging Face values: the
    # architecture's `hf_weight` for a GGUF (the row order, and Gemma 3's norm gains stored as
    # 1 + w); None: they are the Hugging Face values
    hf_values: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    @property
    def row_bytes(self) -> int:
        """The bytes of one stored row (the last dimension)."""
        return self.data.size // max(prod(self.shape[:-1]), 1)

    def dense(self, dtype=np.float32) -> np.ndarray:
        """A new array of `dtype` in Hugging Face layout and values (dequantized, rows in order)."""
        if self.ggml_type == GGMLType.F64:
            return self.data.view("<f8").reshape(self.shape).astype(dtype)
        values = dequantize(self.data, self.ggml_type, self.shape)  # a new float32 array
        if self.hf_values is not None:
            values = self.hf_values(values)
        return values.astype(dtype, copy=False)


class StoredFolder:
    """The stored weights of a model folder (`path`), every source checked on construction:
    `source`, the file that names them (source.gguf, model.safetensors or the index), `files`,
    those that hold their bytes, and `tensors`, every weight by Hugging Face name (for a GGUF, not
    the RoPE factors llama.cpp stores beside them: they follow from config.json)."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        if not self.path.is_dir():
            what = "no such folder" if not self.path.exists() else "not a folder"
            raise PymlError(f"{self.path}: {what}")
        gguf_path = self.path / SOURCE_GGUF
        if gguf_path.is_symlink() or gguf_path.exists():
            self.source, self.files = SOURCE_GGUF, [gguf_path]
            self.tensors = _gguf_tensors(gguf_path)
        elif (self.path / MODEL_FILE).exists():
            self.source, self.files = MODEL_FILE, [self.path / MODEL_FILE]
            self.tensors = _safetensors_tensors(self.path / MODEL_FILE)
        elif (self.path / INDEX_FILE).exists():
            self.source = INDEX_FILE
            self.tensors, self.files = _sharded_tensors(self.path / INDEX_FILE)
        else:
            raise PymlError(
                f"{self.path} holds no weights: no {SOURCE_GGUF}, {MODEL_FILE} or {INDEX_FILE} "
                "(import a GGUF with `pyml import-gguf`, or give a Hugging Face model folder)"
            )

    def dense_tensors(self, dtype=np.float32) -> dict[str, np.ndarray]:
        """Every weight as a new array of `dtype` in Hugging Face layout and values: what a
        generated package's `load_tensors` takes."""
        return {name: tensor.dense(dtype) for name, tensor in self.tensors.items()}

    @property
    def nbytes(self) -> int:
        """The stored bytes of the weights."""
        return sum(tensor.data.size for tensor in self.tensors.values())

    def is_float32(self) -> bool:
        """Whether every weight is stored as float32 (so a float32 model of it is no bigger)."""
        return all(tensor.ggml_type == GGMLType.F32 for tensor in self.tensors.values())

    def describe(self) -> str:
        """What holds the weights, in which encodings (most bytes first) and how big: e.g.
        "source.gguf (Q8_0, F32, 1.37 GiB)", "model.safetensors.index.json (BF16, 2 shards, 3.09 GiB)"."""
        by_type: dict[GGMLType, int] = {}
        for tensor in self.tensors.values():
            by_type[tensor.ggml_type] = by_type.get(tensor.ggml_type, 0) + tensor.data.size
        types = sorted(by_type, key=lambda kind: -by_type[kind])
        shards = [f"{len(self.files)} shards"] if self.source == INDEX_FILE else []
        return f"{self.source} ({', '.join([*(kind.name for kind in types), *shards, size_text(self.nbytes)])})"


def stored_weights(path: Path, dtype=np.float32) -> tuple[dict[str, np.ndarray], str]:
    """The weights of `path` as new arrays of `dtype` (what `load_tensors` takes), and what they
    were read from, to name in errors: `path` a model folder (its stored weights), or a
    safetensors file itself (as `pyml train --init` takes one)."""
    path = Path(path)
    if path.is_dir():
        stored = StoredFolder(path)
        return stored.dense_tensors(dtype), str(stored.path / stored.source)
    return {name: array.astype(dtype, copy=False) for name, array in read_safetensors(path).items()}, str(path)


def size_text(nbytes: int) -> str:
    """A size as people read it: 1.37 GiB, 94.0 MiB, 12.5 KiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def _gguf_tensors(path: Path) -> dict[str, StoredTensor]:
    if not path.exists():  # a symbolic link whose file is gone
        target = Path(os.readlink(path))
        raise PymlError(
            f"{path}: the GGUF it points to, {target}, is missing: it was moved or deleted; "
            "import it again"
        )
    gguf = read_gguf(path)  # checks every tensor's bytes lie within the file
    architecture = architecture_of(gguf)
    check_tensors(gguf, architecture)
    derived = architecture.derived_tensors()  # follow from the config: no weights
    tensors = {}
    for gguf_name, tensor in gguf.tensors.items():
        if gguf_name in derived:
            continue
        name = architecture.hf_name(gguf_name)
        tensors[name] = StoredTensor(
            name, tensor.ggml_type, tensor.shape, tensor.data,
            _row_order(architecture, gguf_name, tensor.shape),
            partial(architecture.hf_weight, gguf_name),
        )  # fmt: skip
    return tensors


def _row_order(architecture: Llama, gguf_name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """Where the file stores each Hugging Face row of a matrix: on a matrix `hf_weight` only
    reorders rows (llama's Q and K), so it shows the order when given the row numbers."""
    if len(shape) != 2:
        return None
    rows = np.arange(shape[0])
    order = architecture.hf_weight(gguf_name, rows[:, None])[:, 0]
    return None if np.array_equal(order, rows) else np.ascontiguousarray(order)


def _safetensors_tensors(path: Path) -> dict[str, StoredTensor]:
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # checks every tensor's bytes lie within the file, with no gaps or overlaps
            entries, data_start = read_header(path, handle, size)
            # mmap refuses an empty mapping; a header with no tensors needs none
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if entries else None
    except FileNotFoundError:
        raise PymlError(f"{path}: no such file") from None
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None
    tensors = {}
    for name, (dtype, shape, begin) in entries.items():
        if dtype not in SAFETENSORS_TYPES:
            raise PymlError(
                f"{path}: tensor {name!r} has dtype {dtype}, which is not a weight dtype pyml reads "
                f"({', '.join(SAFETENSORS_TYPES)})"
            )
        ggml_type, itemsize = SAFETENSORS_TYPES[dtype]
        data = np.frombuffer(buffer, np.uint8, prod(shape) * itemsize, data_start + begin)
        tensors[name] = StoredTensor(name, ggml_type, shape, data)
    return tensors


def _sharded_tensors(index_path: Path) -> tuple[dict[str, StoredTensor], list[Path]]:
    """The tensors the index's weight map names, each from the shard it names, and the shards."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PymlError(f"{index_path}: cannot read: {error.strerror}") from None
    except (UnicodeDecodeError, ValueError):
        raise PymlError(f"{index_path}: not JSON") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise PymlError(f'{index_path}: no "weight_map" of tensor names to shard files')
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    tensors = {}
    for shard, names in by_shard.items():
        if Path(shard).name != shard:
            raise PymlError(f"{index_path}: shard {shard!r} is not a file name in {index_path.parent}")
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise PymlError(
                f"{index_path}: names shard {shard}, which is missing from {index_path.parent}: "
                "download the model again"
            )
        in_shard = _safetensors_tensors(shard_path)
        for name in names:
            if name not in in_shard:
                raise PymlError(f"{index_path}: tensor {name!r} is not in {shard}, as it says")
            tensors[name] = in_shard[name]
    return tensors, [index_path.parent / shard for shard in by_shard]
