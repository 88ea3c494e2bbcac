"""Our GGML dequantisers against `gguf.quants.dequantize`, the gguf package's independent numpy port
of llama.cpp's reference decoders: bit for bit, on random blocks and on every tensor of the real
SmolLM2 and Gemma 3 GGUFs (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0); plus hand-decoded blocks that show the
layouts."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as reference_dequantize

from pyml.formats import gemma3_gguf, smollm2_gguf
from pyml.weight_formats import FORMATS, GGMLType, dequantize, tensor_nbytes


def same_bits(ours: np.ndarray, reference: np.ndarray) -> bool:
    """Equal as float32 bit patterns, except that any NaN matches any NaN."""
    if ours.shape != reference.shape or reference.dtype != np.float32 or ours.dtype != np.float32:
        return False
    both_nan = np.isnan(ours) & np.isnan(reference)
    return bool(np.all((ours.view(np.uint32) == reference.view(np.uint32)) | both_nan))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference on NaN scales
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.name)
def test_random_blocks_match_reference(ggml_type, seed):
    # Random bytes reach every float16 scale, including subnormals, infinities and NaNs, and every
    # packed integer.
    values_per_block, bytes_per_block = FORMATS[ggml_type].block_values, FORMATS[ggml_type].block_bytes
    rows, columns = 37, 2 * 256
    raw = np.random.default_rng([ggml_type.value, seed]).integers(
        0, 256, size=(rows, columns // values_per_block * bytes_per_block), dtype=np.uint8
    )
    ours = dequantize(raw.reshape(-1), ggml_type, (rows, columns))
    assert same_bits(ours, reference_dequantize(raw, gguf.GGMLQuantizationType(ggml_type.value)))


@pytest.mark.parametrize("ggml_type", [t for t in FORMATS if FORMATS[t].block_values > 1], ids=lambda t: t.name)
def test_random_blocks_with_ordinary_scales_match_reference(ggml_type):
    # Every float16 in the block set to an ordinary scale (0.001 to 1, either sign), so that the
    # values are finite and every bit of them is compared.
    values_per_block, bytes_per_block = FORMATS[ggml_type].block_values, FORMATS[ggml_type].block_bytes
    rng = np.random.default_rng(ggml_type.value)
    raw = rng.integers(0, 256, size=(64, bytes_per_block), dtype=np.uint8)
    scales = (rng.choice([-1, 1], 64) * 10 ** rng.uniform(-3, 0, 64)).astype(np.float16)
    for start in F16_OFFSETS[ggml_type]:
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(64, 2)
    ours = dequantize(raw.reshape(-1), ggml_type, (64, values_per_block))
    reference = reference_dequantize(raw, gguf.GGMLQuantizationType(ggml_type.value))
    assert np.isfinite(ours).all() and same_bits(ours, reference)


# Where each block keeps its float16 scales (d, and m or dmin).
F16_OFFSETS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


@pytest.mark.parametrize("shipped", [smollm2_gguf, gemma3_gguf], ids=["smollm2", "gemma3"])
def test_every_tensor_of_the_real_ggufs_matches_reference(shipped):
    reader = gguf.GGUFReader(shipped.shipped_gguf_path())
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
        ours = dequantize(raw, GGMLType(int(tensor.tensor_type)), shape)
        assert same_bits(ours, reference_dequantize(tensor.data, tensor.tensor_type)), tensor.name


def test_the_gemma_gguf_uses_k_quants():
    reader = gguf.GGUFReader(gemma3_gguf.shipped_gguf_path())
    assert {tensor.tensor_type.name for tensor in reader.tensors} == {
        "F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"
    }


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


def _fifth_bits_u32(values: list[int]) -> list[int]:
    """The u32 (little-endian bytes) whose bit j is bit 4 of value j."""
    return list(int(sum((v >> 4) << j for j, v in enumerate(values))).to_bytes(4, "little"))


def test_q5_0_block_by_hand():
    quants = [(7 * j) % 32 for j in range(32)]
    raw = np.array(
        _f16_bytes(0.5) + _fifth_bits_u32(quants) + _packed_nibbles([q & 15 for q in quants]),
        dtype=np.uint8,
    )
    assert dequantize(raw, GGMLType.Q5_0, (32,)).tolist() == [(q - 16) * 0.5 for q in quants]


def _k_scales_and_mins(scales: list[int], mins: list[int]) -> list[int]:
    """The 12 bytes of Q4_K's and Q5_K's 8 six-bit scales and mins (llama.cpp's get_scale_min_k4)."""
    packed = [0] * 12
    for j in range(4):
        packed[j] = scales[j] | (scales[j + 4] >> 4) << 6
        packed[j + 4] = mins[j] | (mins[j + 4] >> 4) << 6
        packed[j + 8] = (scales[j + 4] & 15) | (mins[j + 4] & 15) << 4
    return packed


SCALES = [1, 63, 17, 32, 5, 48, 33, 60]
MINS = [0, 62, 9, 31, 63, 16, 40, 2]


def test_q4_k_block_by_hand():
    # Sub-block s (32 values) has gain d * SCALES[s] and offset dmin * MINS[s]; bytes 32c..32c + 31
    # hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
    quants = [(5 * i + 3 * (i // 32)) % 16 for i in range(256)]
    packed = [quants[64 * c + i] | quants[64 * c + 32 + i] << 4 for c in range(4) for i in range(32)]
    raw = np.array(
        _f16_bytes(0.25) + _f16_bytes(0.125) + _k_scales_and_mins(SCALES, MINS) + packed,
        dtype=np.uint8,
    )
    expected = [0.25 * SCALES[i // 32] * quants[i] - 0.125 * MINS[i // 32] for i in range(256)]
    assert dequantize(raw, GGMLType.Q4_K, (256,)).tolist() == expected


def test_q6_k_block_by_hand():
    # 6-bit values q - 32 in 16 sub-blocks of 16 with int8 scales. Value 128h + 64t + i (i < 64)
    # keeps its low nibble in byte 64h + i (t = 0: low nibble, t = 1: high) and value
    # 128h + 32k + i (i < 32) its top two bits in bits 2k of byte 128 + 32h + i.
    quants = [(11 * i + i // 16) % 64 for i in range(256)]
    low = [0] * 128
    high = [0] * 64
    for h in range(2):
        for t in range(2):
            for i in range(64):
                low[64 * h + i] |= (quants[128 * h + 64 * t + i] & 15) << (4 * t)
        for k in range(4):
            for i in range(32):
                high[32 * h + i] |= (quants[128 * h + 32 * k + i] >> 4) << (2 * k)
    scales = [-128, 127, 1, -1, 50, -50, 3, 7, -9, 11, 13, -15, 17, 0, 64, -64]
    raw = np.array(
        low + high + list(np.array(scales, np.int8).view(np.uint8)) + _f16_bytes(0.5),
        dtype=np.uint8,
    )
    expected = [0.5 * scales[i // 16] * (quants[i] - 32) for i in range(256)]
    assert dequantize(raw, GGMLType.Q6_K, (256,)).tolist() == expected


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
    assert tensor_nbytes(GGMLType.Q6_K, (3, 512)) == 3 * 2 * 210
    with pytest.raises(ValueError, match="whole Q8_0 blocks"):
        tensor_nbytes(GGMLType.Q8_0, (2, 48))
    with pytest.raises(ValueError, match="whole Q4_K blocks of 256"):
        tensor_nbytes(GGMLType.Q4_K, (2, 640))


def test_wrong_byte_count_is_refused():
    with pytest.raises(ValueError, match="needs 36 bytes"):
        dequantize(np.zeros(35, np.uint8), GGMLType.Q4_0, (2, 32))
