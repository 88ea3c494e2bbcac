"""Bad files give one PymlError line, quickly: never another exception, never a hang.

GGUF: the real SmolLM2 and Gemma 3 files truncated at many offsets (inside the header and inside
the tensor data), and their headers corrupted field by field (SmolLM2's also by hypothesis). The
fields are located with the gguf package's own reader, independently of our parser; `pyml
import-gguf` reports such files in one line, exits 2 and writes nothing. Safetensors: hand-made lies about the header length,
offsets and sizes, and hypothesis mutations of valid files, checked against the safetensors library:
whatever we accept, it must accept too and read the same bytes.
"""

import json
import shutil
import signal
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyml.errors import PymlError
from pyml.formats import gemma3_gguf
from pyml.formats.gguf_architectures import architecture_of
from pyml.formats.gguf_import import check_tensors, import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.formats.safetensors_io import read_safetensors, write_safetensors
from pyml.formats.smollm2_gguf import shipped_gguf_path
from pyml.formats.tokenizer import build_tokenizer

SECONDS_ALLOWED = 10  # a parse takes well under a second; more than this is a hang


@contextmanager
def deadline(seconds: float = SECONDS_ALLOWED):
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_gguf(path: Path) -> None:
    """Everything import_gguf checks before it decodes: the container, the dims, the tensors
    against the dims, and the tokenizer."""
    with deadline():
        parsed = read_gguf(path)
        check_tensors(parsed, architecture_of(parsed))
        build_tokenizer(parsed)


def assert_one_line_error(error: PymlError, path: Path) -> None:
    message = str(error)
    assert message.startswith(f"{path}: ") and "\n" not in message, message


# -- GGUF


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return shipped_gguf_path()


@pytest.fixture(scope="module")
def layout(real_gguf):
    return layout_of(real_gguf)


def layout_of(path: Path) -> "Layout":
    """Where the header's fields lie in the file, found by the gguf package's reader."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def where(part: np.ndarray) -> tuple[int, int]:
        return part.ctypes.data - base, part.nbytes

    fields = {name: [where(part) for part in field.parts] for name, field in reader.fields.items()}
    tensors = {
        tensor.name: [where(part) for part in tensor.field.parts] for tensor in reader.tensors
    }
    return Layout(fields=fields, tensors=tensors, data_start=reader.data_offset)


class Layout(dict):
    """(offset, size) of each part of each metadata field and tensor info; short in reports."""

    def __repr__(self) -> str:
        return "Layout(...)"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def gguf_copy(real_gguf, scratch) -> Path:
    """A copy of the real file to corrupt in place (each test restores what it changes)."""
    return Path(shutil.copyfile(real_gguf, scratch / "copy.gguf"))


@contextmanager
def patched(path: Path, offset: int, replacement: bytes):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(len(replacement))
        handle.seek(offset)
        handle.write(replacement)
    try:
        yield
    finally:
        with open(path, "r+b") as handle:
            handle.seek(offset)
            handle.write(original)


def test_the_real_file_passes(gguf_copy):
    check_gguf(gguf_copy)


def truncation_points(layout, size: int) -> list[int]:
    header_end = layout["data_start"]
    field_starts = sorted(
        {offset for parts in layout["fields"].values() for offset, _ in parts[:4]}
    )
    tensor_starts = sorted({offset for parts in layout["tensors"].values() for offset, _ in parts})
    inside_header = np.linspace(25, header_end, 40, dtype=int).tolist()
    inside_data = np.linspace(header_end + 1, size - 1, 8, dtype=int).tolist()
    return sorted(
        {0, 1, 3, 4, 5, 8, 12, 16, 23, 24}
        | set(field_starts[:60])
        | {start + 3 for start in field_starts[:20]}
        | set(tensor_starts[:30])
        | set(inside_header)
        | set(inside_data)
        | {size - 1}
    )


def test_truncated_anywhere_is_an_error(real_gguf, layout, scratch):
    assert_truncations_are_errors(real_gguf, layout, scratch / "truncated.gguf")


def assert_truncations_are_errors(real_gguf: Path, layout, path: Path) -> None:
    size = real_gguf.stat().st_size
    points = truncation_points(layout, size)
    assert len(points) > 150
    data = real_gguf.read_bytes()
    for length in points:
        path.write_bytes(data[:length])
        with pytest.raises(PymlError) as error:
            check_gguf(path)
        assert_one_line_error(error.value, path)


def test_truncated_import_writes_nothing(real_gguf, tmp_path):
    path = tmp_path / "half.gguf"
    path.write_bytes(real_gguf.read_bytes()[: real_gguf.stat().st_size // 2])
    with pytest.raises(PymlError, match="runs past the end of the file"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def field_part(layout, field: str, index: int) -> int:
    return layout["fields"][field][index][0]


def tensor_part(layout, tensor: str, index: int) -> int:
    """Parts of a tensor info: 0 name length, 1 name, 2 n_dims, 3 dims, 4 type, 5 offset."""
    return layout["tensors"][tensor][index][0]


# (what is corrupted, where, new bytes, the error's words); `where` is a function of the layout.
HEADER_CORRUPTIONS = [
    ("magic", lambda l: 0, b"GGUX", "not a GGUF file"),
    ("version 1", lambda l: 4, u32(1), "GGUF version 1 is not supported"),
    ("version 99", lambda l: 4, u32(99), "GGUF version 99"),
    ("big-endian version", lambda l: 4, struct.pack(">I", 3), "big-endian"),
    ("10^12 tensors", lambda l: 8, u64(10**12), "claims 1000000000000 tensors"),
    ("10^12 metadata entries", lambda l: 16, u64(10**12), "claims 1000000000000 metadata"),
    ("2^63-byte key", lambda l: 24, u64(2**63), "truncated"),
    (
        "unknown value type",
        lambda l: field_part(l, "general.architecture", 2),
        u32(99),
        "99, not a GGUF value type",
    ),
    ("key not UTF-8", lambda l: field_part(l, "general.type", 1), b"\xff", "not valid UTF-8"),
    ("repeated key", lambda l: field_part(l, "general.type", 1), b"general.name", "appears twice"),
    (
        "architecture",
        lambda l: field_part(l, "general.architecture", 4),
        b"llamb",
        "architecture 'llamb' is not supported",
    ),
    (
        "10^12 tokens",
        lambda l: field_part(l, "tokenizer.ggml.tokens", 4),
        u64(10**12),
        "claims 1000000000000 elements in metadata 'tokenizer.ggml.tokens'",
    ),
    (
        "2^63-byte token",
        lambda l: field_part(l, "tokenizer.ggml.tokens", 5),
        u64(2**63),
        "truncated",
    ),
    (
        "token array of arrays",
        lambda l: field_part(l, "tokenizer.ggml.tokens", 3),
        u32(9),
        "tokenizer.ggml.tokens",
    ),
    (
        "merge without a space",
        lambda l: field_part(l, "tokenizer.ggml.merges", 6) + 2,
        b"_",
        "BPE merge",
    ),
    (
        "pre-tokenizer",
        lambda l: field_part(l, "tokenizer.ggml.pre", 4),
        b"smollx",
        "pre-tokenizer 'smollx' is not supported",
    ),
    (
        "block count",
        lambda l: field_part(l, "llama.block_count", 3),
        u32(31),
        "llama.block_count is 31, but the file holds only 272 tensors",
    ),
    (
        "4 billion blocks",
        lambda l: field_part(l, "llama.block_count", 3),
        u32(2**32 - 1),
        "llama.block_count is 4294967295",
    ),
    ("rank 0", lambda l: tensor_part(l, "blk.0.ffn_up.weight", 2), u32(0), "0 dimensions"),
    ("rank 5", lambda l: tensor_part(l, "blk.0.ffn_up.weight", 2), u32(5), "5 dimensions"),
    (
        "vocab rows",
        lambda l: tensor_part(l, "token_embd.weight", 3) + 8,
        u64(49151),
        r"expected shape \(49152, 576\), observed \(49151, 576\)",
    ),
    (
        "huge dim",
        lambda l: tensor_part(l, "blk.3.attn_q.weight", 3) + 8,
        u64(2**62),
        "runs past the end",
    ),
    ("IQ4_NL tensor", lambda l: tensor_part(l, "blk.0.attn_q.weight", 4), u32(20), "has type IQ4_NL"),
    (
        "unknown tensor type",
        lambda l: tensor_part(l, "blk.0.attn_q.weight", 4),
        u32(999),
        "unknown type 999",
    ),
    (
        "offset past the end",
        lambda l: tensor_part(l, "output_norm.weight", 5),
        u64(2**40),
        "runs past the end",
    ),
    (
        "misaligned offset",
        lambda l: tensor_part(l, "blk.0.ffn_down.weight", 5),
        u64(30081024 + 2304 + 1),
        "not a multiple of 32",
    ),
    (
        "overlapping tensors",
        lambda l: tensor_part(l, "blk.0.ffn_down.weight", 5),
        u64(0),
        "overlap",
    ),
    (
        "repeated tensor",
        lambda l: tensor_part(l, "blk.0.ffn_up.weight", 1),
        b"blk.1.ffn_up.weight",
        "'blk.1.ffn_up.weight' appears twice",
    ),
]


@pytest.mark.parametrize(
    "where, replacement, message",
    [case[1:] for case in HEADER_CORRUPTIONS],
    ids=[case[0] for case in HEADER_CORRUPTIONS],
)
def test_corrupt_header_field_is_named(gguf_copy, layout, where, replacement, message):
    with patched(gguf_copy, where(layout), replacement):
        with pytest.raises(PymlError, match=message) as error:
            check_gguf(gguf_copy)
    assert_one_line_error(error.value, gguf_copy)


def test_missing_empty_and_directory_paths(tmp_path):
    with pytest.raises(PymlError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")
    with pytest.raises(PymlError, match="not a regular file"):
        read_gguf(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(PymlError, match="not a GGUF file"):
        read_gguf(tmp_path / "empty.gguf")


def structural_fields(layout) -> st.SearchStrategy[tuple[int, int]]:
    """(offset, size) of a count, length, type or offset in the header, leaving out the string
    bytes and all but the first few elements of the long arrays; metadata fields as often as
    tensor infos, though there are 272 tensors and 33 metadata entries."""
    metadata = []
    for parts in layout["fields"].values():
        if len(parts) == 1:  # the file's version and counts
            metadata += parts
            continue
        # key length, key, value type, then value parts (array: element type, length, elements)
        metadata += [parts[0], parts[2]] + [part for part in parts[3:9] if part[1] in (4, 8)]
    tensor_infos = [part for parts in layout["tensors"].values() for part in (parts[0], *parts[2:])]
    return st.sampled_from(sorted(set(metadata))) | st.sampled_from(tensor_infos)


INTERESTING_VALUES = st.sampled_from(
    [0, 1, 2, 3, 4, 8, 9, 12, 31, 32, 33, 255, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 10**12]
) | st.integers(0, 2**64 - 1)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=INTERESTING_VALUES)
def test_any_header_field_set_to_any_value(gguf_copy, layout, data, value):
    offset, size = data.draw(structural_fields(layout), label="field")
    replacement = (value % 2 ** (8 * size)).to_bytes(size, "little")
    with patched(gguf_copy, offset, replacement):
        try:
            check_gguf(gguf_copy)
        except PymlError as error:
            assert_one_line_error(error, gguf_copy)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=st.integers(0, 255))
def test_any_header_byte_set_to_any_value(gguf_copy, layout, data, value):
    offset = data.draw(st.integers(0, layout["data_start"] - 1), label="offset")
    with patched(gguf_copy, offset, bytes([value])):
        try:
            check_gguf(gguf_copy)
        except PymlError as error:
            assert_one_line_error(error, gguf_copy)


# -- the Gemma 3 GGUF: a second architecture, a SentencePiece tokenizer and K-quants


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return gemma3_gguf.shipped_gguf_path()


@pytest.fixture(scope="module")
def gemma_layout(gemma_gguf):
    return layout_of(gemma_gguf)


@pytest.fixture(scope="module")
def gemma_copy(gemma_gguf, scratch) -> Path:
    return Path(shutil.copyfile(gemma_gguf, scratch / "gemma.gguf"))


def test_the_real_gemma_file_passes(gemma_copy):
    check_gguf(gemma_copy)


@pytest.mark.slow
def test_truncated_gemma_anywhere_is_an_error(gemma_gguf, gemma_layout, scratch):
    assert_truncations_are_errors(gemma_gguf, gemma_layout, scratch / "gemma_truncated.gguf")


def f32(value: float) -> bytes:
    return struct.pack("<f", value)


GEMMA_HEADER_CORRUPTIONS = [
    (
        "architecture",
        lambda l: field_part(l, "general.architecture", 4),
        b"gemma4",
        "architecture 'gemma4' is not supported",
    ),
    (
        "block count",
        lambda l: field_part(l, "gemma3.block_count", 3),
        u32(19),
        "gemma3.block_count is 19, but the file holds only 236 tensors",
    ),
    (
        "fewer blocks",
        lambda l: field_part(l, "gemma3.block_count", 3),
        u32(17),
        r"tensors 'blk.17.attn_k.weight'.* are not part of a gemma3 model with 17 layers",
    ),
    (
        "head size",
        lambda l: field_part(l, "gemma3.attention.key_length", 3),
        u32(128),
        "attention value length differs from the key length",
    ),
    (
        "query heads",
        lambda l: field_part(l, "gemma3.attention.head_count", 3),
        u32(8),
        r"'blk.0.attn_output.weight': expected shape \(640, 2048\), observed \(640, 1024\)",
    ),
    (
        "no sliding window",
        lambda l: field_part(l, "gemma3.attention.sliding_window", 3),
        u32(0),
        "gemma3.attention.sliding_window is 0, not a positive integer",
    ),
    (
        "negative epsilon",
        lambda l: field_part(l, "gemma3.attention.layer_norm_rms_epsilon", 3),
        f32(-1.0),
        "layer_norm_rms_epsilon is -1.0, not a positive number",
    ),
    (
        "tokenizer model",
        lambda l: field_part(l, "tokenizer.ggml.model", 4),
        b"llamb",
        "tokenizer model 'llamb' is not supported",
    ),
    (
        "scores of another type",
        lambda l: field_part(l, "tokenizer.ggml.scores", 3),
        u32(5),  # int32: as many bytes per token as the float32 scores
        "tokenizer.ggml.scores is not one number per token",
    ),
    (
        "unknown token id",
        lambda l: field_part(l, "tokenizer.ggml.unknown_token_id", 3),
        u32(262144),
        "tokenizer.ggml.unknown_token_id is 262144, not a token id below 262144",
    ),
    (
        "K-quant rows",
        lambda l: tensor_part(l, "blk.0.attn_output.weight", 3),
        u64(1000),
        "rows of 1000 values are not whole Q4_K blocks of 256",
    ),
    ("IQ2_XS tensor", lambda l: tensor_part(l, "blk.0.ffn_down.weight", 4), u32(17), "has type IQ2_XS"),
]


@pytest.mark.parametrize(
    "where, replacement, message",
    [case[1:] for case in GEMMA_HEADER_CORRUPTIONS],
    ids=[case[0] for case in GEMMA_HEADER_CORRUPTIONS],
)
def test_corrupt_gemma_header_field_is_named(gemma_copy, gemma_layout, where, replacement, message):
    with patched(gemma_copy, where(gemma_layout), replacement):
        with pytest.raises(PymlError, match=message) as error:
            check_gguf(gemma_copy)
    assert_one_line_error(error.value, gemma_copy)


def run_import_command(path: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pyml.cli", "import-gguf", str(path), "--out", str(out)],
        capture_output=True, text=True, check=False,
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated in the header", "truncated"),
        ("truncated in the tensors", "runs past the end of the file"),
        ("corrupt block count", "gemma3.block_count is 19"),
        ("IQ2_XS tensor", "has type IQ2_XS, which pyml does not decode"),
    ],
)
def test_bad_gemma_file_is_one_line_exit_2_and_nothing_written(
    gemma_gguf, gemma_layout, tmp_path, damage, message
):
    data = bytearray(gemma_gguf.read_bytes())
    if damage == "truncated in the header":
        data = data[: gemma_layout["data_start"] // 2]
    elif damage == "truncated in the tensors":
        data = data[: len(data) - 1000]
    elif damage == "corrupt block count":
        where = field_part(gemma_layout, "gemma3.block_count", 3)
        data[where : where + 4] = u32(19)
    else:
        where = tensor_part(gemma_layout, "blk.0.ffn_down.weight", 4)
        data[where : where + 4] = u32(17)
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    result = run_import_command(path, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: ") and result.stderr.count("\n") == 1
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


# -- safetensors

VALID = {
    "embed": np.arange(12, dtype=np.float32).reshape(3, 4),
    "bias": np.array([1, -2], dtype=np.int64),
    "scale": np.array(0.5, dtype=np.float16),
}


def safetensors_bytes(header: object, data: bytes = b"", header_length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if header_length is None else header_length
    return length.to_bytes(8, "little") + text + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


F32x2 = entry("F32", [2], 0, 8)

SAFETENSORS_LIES = [
    ("empty file", b"", "too short"),
    ("header length past the end", safetensors_bytes({}, header_length=1000), "exceeds the file"),
    ("header length 2^64-1", safetensors_bytes({}, header_length=2**64 - 1), "exceeds the file"),
    ("not JSON", safetensors_bytes(b"{not json"), "not JSON"),
    ("not UTF-8", safetensors_bytes(b'{"\xff": 1}'), "not JSON"),
    ("deeply nested", safetensors_bytes(b"[" * 100_000 + b"]" * 100_000), "not JSON"),
    ("JSON array", safetensors_bytes([1, 2]), "not a JSON object"),
    ("entry not an object", safetensors_bytes({"w": [1]}), "is not {dtype, shape, data_offsets}"),
    (
        "missing offsets",
        safetensors_bytes({"w": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        "is not {dtype, shape, data_offsets}",
    ),
    ("unknown dtype", safetensors_bytes({"w": entry("F128", [2], 0, 8)}, bytes(8)), "dtype 'F128'"),
    ("negative dim", safetensors_bytes({"w": entry("F32", [-2], 0, 8)}, bytes(8)), "shape"),
    ("float dim", safetensors_bytes({"w": entry("F32", [2.0], 0, 8)}, bytes(8)), "shape"),
    ("bool dim", safetensors_bytes({"w": entry("F32", [True], 0, 4)}, bytes(4)), "shape"),
    (
        "offsets reversed",
        safetensors_bytes({"w": entry("F32", [2], 8, 0)}, bytes(8)),
        "data_offsets",
    ),
    (
        "one offset",
        safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8)),
        "data_offsets",
    ),
    ("data past the end", safetensors_bytes({"w": entry("F32", [4], 0, 16)}, bytes(8)), "past the"),
    (
        "size is not the shape's",
        safetensors_bytes({"w": entry("F32", [3], 0, 8)}, bytes(8)),
        "spans 8 bytes, but F32 \\[3\\] needs 12",
    ),
    ("huge shape", safetensors_bytes({"w": entry("F32", [0, 2**62], 0, 0)}), "too large"),
    ("overlap", safetensors_bytes({"a": F32x2, "b": F32x2}, bytes(8)), "overlaps"),
    ("gap", safetensors_bytes({"a": entry("F32", [2], 8, 16)}, bytes(16)), "gap"),
    ("unclaimed tail", safetensors_bytes({"a": F32x2}, bytes(12)), "4 bytes no tensor claims"),
    (
        "repeated name",
        safetensors_bytes(
            b'{"a": '
            + json.dumps(F32x2).encode()
            + b', "a": '
            + json.dumps(entry("F32", [2], 8, 16)).encode()
            + b"}",
            bytes(16),
        ),
        "names 'a' twice",
    ),
    ("metadata not strings", safetensors_bytes({"__metadata__": {"k": 1}}), "__metadata__"),
]


@pytest.mark.parametrize(
    "content, message",
    [case[1:] for case in SAFETENSORS_LIES],
    ids=[case[0] for case in SAFETENSORS_LIES],
)
def test_safetensors_lies_are_named(tmp_path, content, message):
    path = tmp_path / "lie.safetensors"
    path.write_bytes(content)
    with deadline(), pytest.raises(PymlError, match=message) as error:
        read_safetensors(path)
    assert_one_line_error(error.value, path)


def test_safetensors_truncated_anywhere(tmp_path):
    valid = tmp_path / "valid.safetensors"
    write_safetensors(valid, VALID)
    content = valid.read_bytes()
    path = tmp_path / "cut.safetensors"
    for length in range(len(content)):
        path.write_bytes(content[:length])
        with deadline(), pytest.raises(PymlError) as error:
            read_safetensors(path)
        assert_one_line_error(error.value, path)


ARRAYS = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.sampled_from(
        [np.float32, np.float64, np.float16, np.int8, np.int32, np.uint8, np.int64]
    ).flatmap(
        lambda dtype: st.lists(st.integers(0, 4), max_size=3).map(
            lambda shape: np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
        )
    ),
    max_size=4,
)


def mutations(content: bytes):
    """A valid file's bytes changed in one of the ways a broken writer or disk would."""
    header_length = int.from_bytes(content[:8], "little")
    header = json.loads(content[8 : 8 + header_length])
    n = len(content)
    truncate = st.integers(0, n - 1).map(lambda k: content[:k])
    extend = st.binary(min_size=1, max_size=16).map(lambda tail: content + tail)
    flip = st.tuples(st.integers(0, n - 1), st.integers(0, 255)).map(
        lambda p: content[: p[0]] + bytes([p[1]]) + content[p[0] + 1 :]
    )
    relength = st.integers(0, 2**64 - 1).map(lambda k: k.to_bytes(8, "little") + content[8:])
    names = [name for name in header if name != "__metadata__"]
    if not names:
        return st.one_of(truncate, extend, flip, relength)

    def rewrite(choice):
        name, field, value = choice
        changed = json.loads(json.dumps(header))
        changed[name][field] = value
        text = json.dumps(changed).encode()
        return len(text).to_bytes(8, "little") + text + content[8 + header_length :]

    json_value = (
        st.integers(-3, 2**20) | st.lists(st.integers(-3, 64), max_size=3) | st.text(max_size=4)
    )
    lie = st.tuples(
        st.sampled_from(names),
        st.sampled_from(["dtype", "shape", "data_offsets"]),
        json_value | st.sampled_from(["F32", "F64", "I8", "U8", "BF16", "F16", "I64"]),
    ).map(rewrite)
    return st.one_of(truncate, extend, flip, relength, lie)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensors=ARRAYS, data=st.data())
def test_mutated_safetensors_are_rejected_or_read_like_the_reference(scratch, tensors, data):
    valid = scratch / "valid.safetensors"
    write_safetensors(valid, tensors)
    content = data.draw(mutations(valid.read_bytes()), label="content")
    path = scratch / "mutated.safetensors"
    path.write_bytes(content)
    try:
        with deadline():
            ours = read_safetensors(path)
    except PymlError as error:
        assert_one_line_error(error, path)
        return
    # BF16 has no numpy type: we widen it, the reference's numpy loader refuses it.
    if "BF16" not in content[: 8 + int.from_bytes(content[:8], "little")].decode(
        "utf-8", "replace"
    ):
        theirs = safetensors.numpy.load_file(path)
        assert ours.keys() == theirs.keys()
        for name, array in theirs.items():
            assert (ours[name].dtype, ours[name].shape) == (array.dtype, array.shape)
            assert ours[name].tobytes() == array.tobytes()
