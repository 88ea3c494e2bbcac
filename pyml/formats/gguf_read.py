"""Reading a GGUF file: its metadata and where each tensor's bytes are, validated against the file.

GGUF (llama.cpp's format, versions 2 and 3, little-endian):

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:     key (string) | value type u32 | value
    tensor infos: name (string) | n_dims u32 | ne u64 x n_dims | ggml type u32 | offset u64
    padding to `general.alignment` (default 32), then the data section; tensor offsets count
    from its start. A string is a u64 byte length and UTF-8 bytes; ne[0] is the fastest dimension.

Every count and length is checked against the bytes left in the file before anything is allocated
or looped over, so a corrupt header fails at once with a `PymlError` instead of hanging or raising
a struct/numpy error. The tensor bytes stay in the file (memory-mapped) until someone decodes them.
"""

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import gguf
import numpy as np

from pyml.errors import PymlError
from pyml.weight_formats import FORMATS, GGMLType, tensor_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # the spec allows arrays of arrays; real files nest at most once


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
# The fewest bytes one value of a type can take, used to bound counts before looping.
_MIN_VALUE_SIZE = {
    **{kind: struct.calcsize(fmt) for kind, fmt in _SCALAR_FORMATS.items()},
    ValueType.STRING: 8,
    ValueType.ARRAY: 12,
}
# name, n_dims, one dim, type, offset
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]  # numpy order: the file's ne reversed, fastest dimension last
    data: np.ndarray  # the tensor's bytes, uint8, a read-only view into the mapped file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    # Scalars are int/float/bool/str, numeric arrays np.ndarray, string arrays list[str].
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]  # in file order


def read_gguf(path: Path) -> GGUFFile:
    """Parse and validate the GGUF at `path`; raises PymlError naming the file for any defect."""
    path = Path(path)
    if not path.exists():
        raise PymlError(f"{path}: no such file")
    if not path.is_file():
        raise PymlError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 4:
                raise PymlError(f"{path}: not a GGUF file ({size} bytes, too short for the magic)")
            # The mapping outlives the handle; the tensor views keep it alive.
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None
    return _Parser(path, buffer).parse()


def ggml_type_name(type_id: int) -> str:
    """A type id as llama.cpp names it (Q4_K, IQ2_XS...), for error messages."""
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"


class _Parser:
    def __init__(self, path: Path, buffer: mmap.mmap):
        self.path = path
        self.buffer = buffer
        self.size = len(buffer)
        self.pos = 0

    def fail(self, message: str) -> PymlError:
        return PymlError(f"{self.path}: {message}")

    def parse(self) -> GGUFFile:
        magic = self.buffer[:4]
        if magic != GGUF_MAGIC:
            raise self.fail(f"not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
        self.pos = 4
        version = self.scalar(ValueType.UINT32, "the version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
                raise self.fail("big-endian GGUF files are not supported")
            raise self.fail(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        tensor_count = self.scalar(ValueType.UINT64, "the tensor count")
        metadata_count = self.scalar(ValueType.UINT64, "the metadata count")
        self.check_count(metadata_count, 8 + 4 + 1, "metadata entries")
        self.check_count(tensor_count, _MIN_TENSOR_INFO_SIZE, "tensors")

        metadata: dict[str, object] = {}
        for _ in range(metadata_count):
            key = self.string("a metadata key")
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            kind = self.value_type(f"the type of metadata {key!r}")
            metadata[key] = self.value(kind, key, depth=0)

        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = self.alignment(metadata)
        data_start = -(-self.pos // alignment) * alignment
        tensors = self.locate_tensors(infos, data_start, alignment)
        return GGUFFile(self.path, version, metadata, tensors)

    # -- primitives: each checks that its bytes are in the file before reading them

    def take(self, n: int, what: str) -> int:
        """Advance past `n` bytes, returning where they start."""
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has {self.size}"
            )
        start = self.pos
        self.pos += n
        return start

    def check_count(self, count: int, min_size: int, what: str) -> None:
        if count * min_size > self.size - self.pos:
            raise self.fail(
                f"header claims {count} {what}, more than the {self.size - self.pos} bytes "
                f"left after offset {self.pos} can hold"
            )

    def scalar(self, kind: ValueType, what: str):
        fmt = _SCALAR_FORMATS[kind]
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buffer, start)[0]

    def string(self, what: str) -> str:
        length = self.scalar(ValueType.UINT64, f"the length of {what}")
        start = self.take(length, what)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8") from None

    def value_type(self, what: str) -> ValueType:
        type_id = self.scalar(ValueType.UINT32, what)
        try:
            return ValueType(type_id)
        except ValueError:
            raise self.fail(f"{what} is {type_id}, not a GGUF value type") from None

    def value(self, kind: ValueType, key: str, depth: int):
        if kind == ValueType.STRING:
            return self.string(f"metadata {key!r}")
        if kind != ValueType.ARRAY:
            return self.scalar(kind, f"metadata {key!r}")
        if depth == MAX_ARRAY_NESTING:
            raise self.fail(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_NESTING}")
        element = self.value_type(f"the element type of metadata {key!r}")
        count = self.scalar(ValueType.UINT64, f"the length of metadata {key!r}")
        self.check_count(count, _MIN_VALUE_SIZE[element], f"elements in metadata {key!r}")
        if element in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[element]
            start = self.take(count * dtype.itemsize, f"metadata {key!r}")
            return np.frombuffer(self.buffer, dtype, count, start).astype(dtype.newbyteorder("="))
        return [self.value(element, key, depth + 1) for _ in range(count)]

    # -- tensors

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string("a tensor name")
        n_dims = self.scalar(ValueType.UINT32, f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(
                f"tensor {name!r} has {n_dims} dimensions (GGML allows 1 to {MAX_DIMS})"
            )
        ne = [self.scalar(ValueType.UINT64, f"the shape of tensor {name!r}") for _ in range(n_dims)]
        type_id = self.scalar(ValueType.UINT32, f"the type of tensor {name!r}")
        offset = self.scalar(ValueType.UINT64, f"the offset of tensor {name!r}")
        return name, tuple(reversed(ne)), type_id, offset

    def alignment(self, metadata: dict[str, object]) -> int:
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment is {alignment!r}, not a power of two")
        return alignment

    def locate_tensors(self, infos, data_start: int, alignment: int) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        spans: list[tuple[int, int, str]] = []
        for name, shape, type_id, offset in infos:
            if name in tensors:
                raise self.fail(f"tensor {name!r} appears twice")
            if type_id not in FORMATS:
                supported = ", ".join(t.name for t in FORMATS)
                raise self.fail(
                    f"tensor {name!r} has type {ggml_type_name(type_id)}, "
                    f"which pyml does not decode (supported: {supported})"
                )
            ggml_type = GGMLType(type_id)
            try:
                nbytes = tensor_nbytes(ggml_type, shape)
            except ValueError as error:
                raise self.fail(f"tensor {name!r} of shape {shape}: {error}") from None
            if offset % alignment:
                raise self.fail(f"tensor {name!r} offset {offset} is not a multiple of {alignment}")
            start = data_start + offset
            if start + nbytes > self.size:
                raise self.fail(
                    f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the "
                    f"file ({self.size} bytes): the file is truncated or its header is corrupt"
                )
            data = np.frombuffer(self.buffer, np.uint8, nbytes, start)
            tensors[name] = GGUFTensor(name, ggml_type, shape, data)
            spans.append((start, start + nbytes, name))
        spans.sort()
        for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
            if end > start:
                raise self.fail(f"tensors {before!r} and {after!r} overlap in the file")
        return tensors
