"""Our safetensors reader and writer: round trips, and agreement with the `safetensors` library
(the format's reference implementation) in both directions."""

import json
import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch

from pyml.errors import PymlError
from pyml.formats.safetensors_io import read_safetensors, write_safetensors

ALL_WRITABLE = {
    "f64": np.linspace(-1, 1, 6).reshape(2, 3),
    "f32": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
    "f16": np.array([0.5, -65504.0, np.inf], dtype=np.float16),
    "i64": np.array([-(2**62), 2**62], dtype=np.int64),
    "i32": np.arange(-3, 3, dtype=np.int32),
    "i16": np.array([-(2**15)], dtype=np.int16),
    "i8": np.array([-128, 127], dtype=np.int8),
    "u64": np.array([2**64 - 1], dtype=np.uint64),
    "u32": np.array([7], dtype=np.uint32),
    "u16": np.array([65535], dtype=np.uint16),
    "u8": np.arange(256, dtype=np.uint8).reshape(16, 16),
    "bool": np.array([[True, False], [False, True]]),
    "scalar": np.array(3.25, dtype=np.float32),
    "empty": np.zeros((0, 5), dtype=np.float32),
}


def assert_same_tensors(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype.newbyteorder("="), name
        assert actual[name].shape == array.shape, name
        assert actual[name].tobytes() == array.astype(actual[name].dtype).tobytes(), name


def test_round_trip_every_dtype(tmp_path):
    path = tmp_path / "all.safetensors"
    write_safetensors(path, ALL_WRITABLE, metadata={"format": "pt", "note": "ünïcode"})
    assert_same_tensors(read_safetensors(path), ALL_WRITABLE)


def test_non_contiguous_and_big_endian_inputs_are_stored_as_values(tmp_path):
    path = tmp_path / "layouts.safetensors"
    transposed = np.arange(12, dtype=np.float32).reshape(3, 4).T
    big_endian = np.arange(5, dtype=">i4")
    write_safetensors(path, {"transposed": transposed, "big_endian": big_endian})
    back = read_safetensors(path)
    assert np.array_equal(back["transposed"], transposed)
    assert np.array_equal(back["big_endian"], big_endian) and back["big_endian"].dtype == np.int32


def test_reference_library_reads_what_we_write(tmp_path):
    path = tmp_path / "ours.safetensors"
    metadata = {"format": "pt", "source": "pyml"}
    write_safetensors(path, ALL_WRITABLE, metadata=metadata)
    assert_same_tensors(safetensors.numpy.load_file(path), ALL_WRITABLE)
    with safetensors.safe_open(path, framework="np") as handle:
        assert handle.metadata() == metadata


def test_we_read_what_the_reference_library_writes(tmp_path):
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(ALL_WRITABLE, path, metadata={"format": "np"})
    assert_same_tensors(read_safetensors(path), ALL_WRITABLE)


def test_bfloat16_is_read_widened_to_float32(tmp_path):
    import safetensors.torch

    path = tmp_path / "bf16.safetensors"
    weights = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    safetensors.torch.save_file({"w": weights}, path)
    back = read_safetensors(path)["w"]
    assert back.dtype == np.float32
    assert np.array_equal(back, weights.float().numpy())


def test_header_is_padded_so_tensors_are_aligned(tmp_path):
    path = tmp_path / "aligned.safetensors"
    write_safetensors(path, {"a": np.zeros(3, np.uint8), "b": np.zeros(2, np.float64)})
    raw = path.read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    assert header_length % 8 == 0
    header = json.loads(raw[8 : 8 + header_length])
    assert header["b"]["data_offsets"][0] % 8 == 0  # the float64 comes first


def test_write_replaces_atomically_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"old": np.ones(3, np.float32)})

    def failing_fsync(descriptor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        write_safetensors(path, {"new": np.zeros(1000, np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert list(read_safetensors(path)) == ["old"]


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"c": np.zeros(2, np.complex64)}, "cannot store"),
        ({"o": np.array(["x"], dtype=object)}, "cannot store"),
        ({"l": [1.0, 2.0]}, "not a numpy array"),
    ],
)
def test_unwritable_tensors_are_refused(tmp_path, tensors, message):
    with pytest.raises(PymlError, match=message):
        write_safetensors(tmp_path / "x.safetensors", tensors)
    assert not (tmp_path / "x.safetensors").exists()


def test_missing_file_is_a_pyml_error(tmp_path):
    with pytest.raises(PymlError, match="no such file"):
        read_safetensors(tmp_path / "absent.safetensors")
