"""Our GGML dequantisers against `gguf.quants.dequantize`, the gguf package's independent numpy port
of llama.cpp's reference decoders: bit for bit, on random blocks and on every tensor of the real
SmolLM2 GGUF; plus one hand-decoded block per type that shows the layout."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as reference_dequantize

from pyml.runtime.quant import BLOCK_LAYOUT, GGMLType, dequantize, tensor_nbytes
from pyml.runtime.smollm2_gguf import shipped_gguf_path


def same_bits(ours: np.ndarray, reference: np.ndarray) -> bool:
    """Equal as float32 bit patterns, except that any NaN matches any NaN."""
    if ours.shape != reference.shape or reference.dtype != np.float32 or ours.dtype != np.float32:
        return False
    both_nan = np.isnan(ours) & np.isnan(reference)
    return bool(np.all((ours.view(np.uint32) == reference.view(np.uint32)) | both_nan))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference on NaN scales
@pytest.mark.parametrize("ggml_type", list(GGMLType), ids=lambda t: t.name)
def test_random_blocks_match_reference(ggml_type):
    # Random bytes reach every float16 scale, including subnormals, infinities and NaNs.
    values_per_block, bytes_per_block = BLOCK_LAYOUT[ggml_type]
    rows, columns = 37, 4 * 32
    raw = np.random.default_rng(ggml_type.value).integers(
        0, 256, size=(rows, columns // values_per_block * bytes_per_block), dtype=np.uint8
    )
    ours = dequantize(raw.reshape(-1), ggml_type, (rows, columns))
    assert same_bits(ours, reference_dequantize(raw, gguf.GGMLQuantizationType(ggml_type.value)))


def test_every_tensor_of_the_real_gguf_matches_reference():
    reader = gguf.GGUFReader(shipped_gguf_path())
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
        ours = dequantize(raw, GGMLType(int(tensor.tensor_type)), shape)
        assert same_bits(ours, reference_dequantize(tensor.data, tensor.tensor_type)), tensor.name


def _f16_bytes(value: float) -> list[int]:
    return list(np.float16(value).tobytes())


def _packed_nibbles(values: list[int]) -> list[int]:
    """Byte j holds value j in its low nibble and value j + 16 in its high nibble."""
    return [values[j] | values[j + 16] << 4 for j in range(16)]


NIBBLES = [j % 16 for j in range(32)]


def test_q4_0_block_by_hand():
    raw = np.array(_f16_bytes(0.5) + _packed_nibbles(NIBBLES), dtype=np.uint8)
    expected = [(q - 8) * 0.5 for q in NIBBLES]
    assert dequantize(raw, GGMLType.Q4_0, (32,)).tolist() == expected


def test_q4_1_block_by_hand():
    raw = np.array(_f16_bytes(0.25) + _f16_bytes(-1.0) + _packed_nibbles(NIBBLES), dtype=np.uint8)
    expected = [q * 0.25 - 1.0 for q in NIBBLES]
    assert dequantize(raw, GGMLType.Q4_1, (32,)).tolist() == expected


def test_q8_0_block_by_hand():
    quants = list(range(-16, 16))
    raw = np.array(_f16_bytes(2.0) + list(np.array(quants, np.int8).view(np.uint8)), np.uint8)
    assert dequantize(raw, GGMLType.Q8_0, (32,)).tolist() == [2.0 * q for q in quants]


def test_float_types_by_hand():
    values = np.array([1.5, -2.0, 0.0, 3072.0], dtype=np.float32)
    assert dequantize(values.view(np.uint8), GGMLType.F32, (2, 2)).tolist() == [
        [1.5, -2.0],
        [0.0, 3072.0],
    ]
    assert (
        dequantize(values.astype(np.float16).view(np.uint8), GGMLType.F16, (4,)).tolist()
        == values.tolist()
    )
    bfloat16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact: these values fit in bf16
    assert dequantize(bfloat16.view(np.uint8), GGMLType.BF16, (4,)).tolist() == values.tolist()


def test_rows_must_be_whole_blocks():
    assert tensor_nbytes(GGMLType.Q4_1, (3, 64)) == 3 * 2 * 20
    with pytest.raises(ValueError, match="whole Q8_0 blocks"):
        tensor_nbytes(GGMLType.Q8_0, (2, 48))


def test_wrong_byte_count_is_refused():
    with pytest.raises(ValueError, match="needs 36 bytes"):
        dequantize(np.zeros(35, np.uint8), GGMLType.Q4_0, (2, 32))
