"""Reading and writing safetensors files, validating every claim the header makes.

Layout: an 8-byte little-endian header length N, N bytes of JSON, then the data section. The JSON
maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
data section) plus an optional "__metadata__" of string to string. The data section must be
covered exactly: no gaps, no overlaps, nothing past the end.
"""

import json
import os
from math import prod
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pyml.errors import PymlError
from pyml.outputs import atomic_write

# safetensors dtype name -> little-endian numpy dtype. BF16 has no numpy dtype: it is read as
# its raw 16 bits and widened to float32 (exactly), and cannot be written.
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_WRITABLE_DTYPES = {dtype.str: name for name, dtype in _DTYPES.items() if name != "BF16"}
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of the file at `path`, as new native-endian arrays (BF16 widened to float32)."""
    path = Path(path)
    if not path.is_file():
        raise PymlError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            entries, data_start = read_header(path, handle, file_size)
            return {
                name: _read_tensor(path, handle, name, dtype, shape, data_start + begin)
                for name, (dtype, shape, begin) in entries.items()
            }
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` to `path` atomically: readers see the old file or the whole new one."""
    path = Path(path)
    arrays = {name: _little_endian(path, name, array) for name, array in tensors.items()}
    # Widest itemsize first: with the header padded to 8 bytes every tensor starts aligned.
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise PymlError(f"{path}: safetensors metadata must map strings to strings")
        header[METADATA_KEY] = metadata
    offset = 0
    for name in order:
        array = arrays[name]
        header[name] = {
            "dtype": _WRITABLE_DTYPES[array.dtype.str],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    try:
        header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise PymlError(f"{path}: a tensor name or metadata string is not valid Unicode") from None
    header_bytes += b" " * (-len(header_bytes) % 8)

    def write(handle: BinaryIO) -> None:
        handle.write(len(header_bytes).to_bytes(HEADER_LENGTH_BYTES, "little"))
        handle.write(header_bytes)
        for name in order:
            handle.write(arrays[name].data)

    atomic_write(path, write)


def _little_endian(path: Path, name: str, array: np.ndarray) -> np.ndarray:
    if not isinstance(name, str):
        raise PymlError(f"{path}: tensor name {name!r} is not a string")
    if not isinstance(array, np.ndarray):
        raise PymlError(f"{path}: tensor {name!r} is a {type(array).__name__}, not a numpy array")
    little = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if little.str not in _WRITABLE_DTYPES:
        raise PymlError(
            f"{path}: tensor {name!r} has dtype {array.dtype}, which safetensors cannot store"
        )
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array.astype(little, order="C", copy=False)


def read_header(
    path: Path, handle: BinaryIO, file_size: int
) -> tuple[dict[str, tuple[str, tuple[int, ...], int]], int]:
    """The tensor entries (dtype name, shape, begin offset) and where the data section starts."""

    def fail(message: str) -> PymlError:
        return PymlError(f"{path}: not a valid safetensors file: {message}")

    if file_size < HEADER_LENGTH_BYTES:
        raise fail(f"{file_size} bytes, too short for the header length")
    header_length = int.from_bytes(handle.read(HEADER_LENGTH_BYTES), "little")
    if header_length > min(MAX_HEADER_BYTES, file_size - HEADER_LENGTH_BYTES):
        raise fail(f"header length {header_length} exceeds the file ({file_size} bytes)")
    try:
        header = json.loads(
            handle.read(header_length).decode("utf-8"), object_pairs_hook=_object_without_duplicates
        )
    except _DuplicateKey as duplicate:
        raise fail(f"the header names {duplicate.args[0]!r} twice") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise fail("the header is not JSON") from None
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object")

    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail(f"{METADATA_KEY} is not an object of strings")
    # json.loads lets "\ud800" (half of a surrogate pair) through; it is not Unicode.
    if not all(_is_unicode(text) for text in [*header, *metadata, *metadata.values()]):
        raise fail("a name or metadata string is not valid Unicode")
    data_start = HEADER_LENGTH_BYTES + header_length
    data_size = file_size - data_start
    entries = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
            raise fail(f"tensor {name!r} entry is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise fail(f"tensor {name!r} has unsupported dtype {dtype!r}")
        if not _is_list_of_naturals(shape):
            raise fail(f"tensor {name!r} shape {shape!r} is not a list of non-negative integers")
        # numpy refuses shapes whose extent overflows an index, even when a dimension is zero.
        if prod(max(n, 1) for n in shape) * _DTYPES[dtype].itemsize > np.iinfo(np.intp).max:
            raise fail(f"tensor {name!r} shape {shape!r} is too large for any array")
        if not (_is_list_of_naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise fail(f"tensor {name!r} data_offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        if end > data_size:
            raise fail(
                f"tensor {name!r} data ends at {end}, past the {data_size}-byte data section"
            )
        if end - begin != prod(shape) * _DTYPES[dtype].itemsize:
            raise fail(
                f"tensor {name!r} spans {end - begin} bytes, but {dtype} {shape} needs "
                f"{prod(shape) * _DTYPES[dtype].itemsize}"
            )
        entries[name] = (dtype, tuple(shape), begin)
        spans.append((begin, end, name))
    spans.sort()
    covered = 0
    for begin, end, name in spans:
        if begin != covered:
            what = "overlaps the tensor before it" if begin < covered else "leaves a gap before it"
            raise fail(f"tensor {name!r} at data offset {begin} {what}")
        covered = end
    if covered != data_size:
        raise fail(f"the data section has {data_size - covered} bytes no tensor claims")
    return entries, data_start


class _DuplicateKey(Exception):
    pass


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json.loads keeps the last of repeated keys; a header that repeats a tensor is corrupt.
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_list_of_naturals(value: object) -> bool:
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def _read_tensor(
    path: Path, handle: BinaryIO, name: str, dtype: str, shape: tuple[int, ...], start: int
) -> np.ndarray:
    handle.seek(start)
    count = prod(shape)
    array = np.fromfile(handle, dtype=_DTYPES[dtype], count=count)
    if array.size != count:
        raise PymlError(f"{path}: tensor {name!r} is cut short (the file changed while reading)")
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(array.dtype.newbyteorder("="), copy=False).reshape(shape)
