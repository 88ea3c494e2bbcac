"""Every weight format pyml reads, one module each, as ggml keeps one table of type traits.

A format's module holds all pyml knows of it (`traits.WeightFormat`): its block layout, its
dequantization (numpy, llama.cpp's reference dequantizer bit for bit), its quantizer where pyml
writes it (llama.cpp's reference quantizer, byte for byte), the loop the decode step reads a row
with where the file stores it (LLVM vector IR, `vector_ir`), its int8-activation layout, and the
arrays the CUDA decode step reads. The kernels (pyml/package/decode_cpu.py, quantized_dot.py)
and the readers and writers (pyml/formats) take everything from `FORMATS`; the tests parametrize
over it. So adding a format is a module here and a line in `FORMATS`.

A GGML tensor is stored row by row, the fastest dimension last in numpy order. Quantized types cut
each row into blocks and store a block as float16 scale(s) followed by packed integers. Packed
fields come in runs: a run of n bytes holds 8 // width runs of n values, field k of its byte i
being value k * n + i (the low nibbles of 16 bytes are values 0..15, the high ones 16..31).

    format  block             module       written   decode step
    F32     1 value, 4 bytes  floats       yes       in place
    F16     1, 2              floats       yes       in place
    BF16    1, 2              floats                 in place
    Q4_0    32, 18            q4_0         yes       in place, int8
    Q4_1    32, 20            q4_1         yes       in place, int8
    Q5_0    32, 22            q5_0         yes       in place
    Q5_1    32, 24            q5_1         yes       float32 rows
    Q8_0    32, 34            q8_0         yes       in place, int8
    Q2_K    256, 84           q2_k                   float32 rows
    Q3_K    256, 110          q3_k                   float32 rows
    Q4_K    256, 144          q4_k         yes       in place
    Q5_K    256, 176          q5_k         yes       in place
    Q6_K    256, 210          q6_k         yes       in place

Every row product and dequantized value is computed in float32 in the order the module writes it,
so the results are bit-identical to llama.cpp's reference dequantizers (and to
`gguf.quants.dequantize`, which the tests use).
"""

from math import prod

import numpy as np

from pyml.weight_formats import floats, q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0
from pyml.weight_formats.traits import GGMLType, WeightFormat

FORMATS: dict[GGMLType, WeightFormat] = {
    format.ggml_type: format
    for format in (floats.F32_FORMAT, floats.F16_FORMAT, floats.BF16_FORMAT, q4_0.FORMAT, q4_1.FORMAT,
                   q5_0.FORMAT, q5_1.FORMAT, q8_0.FORMAT, q2_k.FORMAT, q3_k.FORMAT, q4_k.FORMAT,
                   q5_k.FORMAT, q6_k.FORMAT)
}
# the formats pyml writes (`pyml export-gguf`, `--weights`)
ENCODABLE = tuple(ggml_type for ggml_type, format in FORMATS.items() if format.quantize is not None)
BLOCKS_PER_CHUNK = 4096  # 512 KiB of float32 values


def tensor_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (numpy order) takes; its rows must be whole blocks."""
    format = FORMATS[ggml_type]
    if shape and shape[-1] % format.block_values:
        raise ValueError(f"rows of {shape[-1]} values are not whole {format.name} blocks of {format.block_values}")
    return prod(shape) // format.block_values * format.block_bytes


def dequantize(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """A new float32 array of `shape` from the tensor's bytes `raw` (uint8, exactly its size)."""
    expected = tensor_nbytes(ggml_type, shape)
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != expected:
        raise ValueError(f"{ggml_type.name} tensor of shape {shape} needs {expected} bytes")
    format = FORMATS[ggml_type]
    # A scale of inf or NaN decodes to inf/NaN values, as in llama.cpp: no warning for that.
    with np.errstate(invalid="ignore", over="ignore"):
        return format.dequantize(raw.reshape(-1, format.block_bytes)).reshape(shape)


def quantize(weight: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """`weight` (float32, rows of whole blocks) encoded as `ggml_type` (one of ENCODABLE): a
    float32 or float16 array of its shape, or for the block types uint8 of shape (..., bytes per row)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    format = FORMATS[ggml_type]
    if format.quantize is None:
        raise ValueError(f"pyml does not write {format.name}")
    if format.block_values == 1:
        return format.quantize(weight)
    if weight.shape[-1] % format.block_values:
        raise ValueError(f"rows of {weight.shape[-1]} values are not whole {format.name} blocks")
    blocks = weight.reshape(-1, format.block_values)
    encoded = np.empty((len(blocks), format.block_bytes), np.uint8)
    # A chunk at a time, so that the temporaries stay in cache instead of streaming through memory.
    for start in range(0, len(blocks), BLOCKS_PER_CHUNK):
        chunk = slice(start, start + BLOCKS_PER_CHUNK)
        encoded[chunk] = format.quantize(blocks[chunk])
    row_bytes = weight.shape[-1] // format.block_values * format.block_bytes
    return encoded.reshape(*weight.shape[:-1], row_bytes)
