"""K-quant export (`--type q4_k_m`, `q5_k_m`, `q6_k`): llama.cpp's reference quantisers and
llama-quantize's mixes.

References: gguf's dequantisers (a reader of the blocks that is not ours), each format's error
bound, and llama.cpp itself, through llama-cpp-python (`make test` builds it): its
ggml_quantize_chunk must give our bytes for the same values, and its llama_model_quantize of our
float32 export the same tensors, type for type and byte for byte, as our q4_k_m export. Only the
byte comparisons catch an encoder bug that keeps every value within its bound (a missing clamp, a
rounding choice).
"""

import ctypes
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import gguf
import numpy as np
import pytest
import torch

from pyml.formats.gguf_architectures import architecture_of
from pyml.formats.gguf_export import export_gguf, tensor_type, use_more_bits
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.weight_formats import FORMATS, GGMLType, dequantize, quantize
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.decoding import load_model
from tests.support.llama_cpp_reference import llama_cpp_module
from tests.support.model_folders import LLAMA, write_gguf

K_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
# the largest level a value can take: Q4_K and Q5_K span (min, max) in 15 or 31 steps, Q6_K
# +-max|x| in 32 each way
LEVELS = {GGMLType.Q4_K: 15, GGMLType.Q5_K: 31, GGMLType.Q6_K: 32}
# Rows of whole 256-value blocks, and eight layers, so that the mixes' layer rule picks some.
KQUANT_DIMS = LLAMA | {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "ffn": 512, "layers": 8}


def values(kind: str, rng) -> np.ndarray:
    shape = (64, 512)
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "heavy tails":
        return rng.standard_t(2, shape)
    if kind == "spikes":
        return rng.standard_normal(shape) * 0.01 + 50 * (rng.random(shape) < 0.01)
    if kind == "positive":
        return rng.random(shape) + 3
    if kind == "negative":
        return -rng.random(shape) - 3
    if kind == "lognormal":
        return rng.lognormal(0, 2, shape) * rng.choice([-1, 1], shape)
    if kind == "tiny":  # below what the float16 scales can hold
        return rng.standard_normal(shape) * 1e-6
    if kind == "constant blocks":
        return np.repeat(rng.standard_normal((64, 2)), 256, axis=1)
    return np.zeros(shape)


KINDS = ["normal", "heavy tails", "spikes", "positive", "negative", "lognormal", "tiny",
         "constant blocks", "zeros"]


def assert_within_one_step(weight: np.ndarray, decoded: np.ndarray, ggml_type: GGMLType) -> None:
    """Each value decodes within one step of its 256-value block's grid, (max - min) / 15 or 31
    (Q4_K, Q5_K; min and max with 0) or max|x| / 32 (Q6_K), plus the floor under which the
    float16 block scale underflows."""
    blocks = weight.reshape(-1, 256)
    if ggml_type == GGMLType.Q6_K:
        span = np.abs(blocks).max(axis=1)
    else:
        span = blocks.max(axis=1).clip(0) - blocks.min(axis=1).clip(None, 0)
    floor = LEVELS[ggml_type] * 128 * 2.0**-24
    error = np.abs(decoded - weight).reshape(-1, 256).max(axis=1)
    assert np.all(error <= span / LEVELS[ggml_type] + floor), (error / (span / LEVELS[ggml_type])).max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_every_value_decodes_within_one_step_of_its_block(ggml_type, kind):
    """On values of every shape of distribution; gguf's decoder reads the same values as ours."""
    weight = values(kind, np.random.default_rng(KINDS.index(kind))).astype(np.float32)
    encoded = quantize(weight, ggml_type)
    ours = dequantize(encoded.reshape(-1), ggml_type, weight.shape)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(encoded, gguf.GGMLQuantizationType(int(ggml_type))))
    assert_within_one_step(weight, ours, ggml_type)


def test_the_mixes_choose_tensor_types_as_llama_quantize():
    assert [use_more_bits(layer, 8) for layer in range(8)] == [True, False, False, True, False, False, True, True]
    assert [layer for layer in range(30) if use_more_bits(layer, 30)] == [
        0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    q4, q5, q6 = GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K
    for asked in (q4, q5):
        assert tensor_type("blk.0.attn_v.weight", (128, 256), asked, 8, True) == q6
        assert tensor_type("blk.1.attn_v.weight", (128, 256), asked, 8, True) == asked
        assert tensor_type("blk.6.ffn_down.weight", (256, 512), asked, 8, True) == q6
        assert tensor_type("blk.1.attn_q.weight", (256, 256), asked, 8, True) == asked
    assert tensor_type("blk.1.attn_v.weight", (128, 256), q6, 8, True) == q6
    assert tensor_type("token_embd.weight", (96, 256), q4, 8, True) == q6  # tied: the output
    assert tensor_type("token_embd.weight", (96, 256), q4, 8, False) == q4
    assert tensor_type("output.weight", (96, 256), q4, 8, False) == q6
    assert tensor_type("output.weight", (96, 576), q4, 8, False) == GGMLType.Q8_0  # no 256 blocks
    # rows of no whole 256-value block fall back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, then F16
    assert tensor_type("blk.1.attn_q.weight", (576, 576), q4, 8, True) == GGMLType.Q5_0
    assert tensor_type("blk.1.attn_q.weight", (576, 576), q5, 8, True) == GGMLType.Q5_1
    assert tensor_type("blk.1.attn_q.weight", (576, 576), q6, 8, True) == GGMLType.Q8_0
    assert tensor_type("blk.1.attn_q.weight", (40, 40), q4, 8, True) == GGMLType.F16
    assert tensor_type("blk.1.attn_norm.weight", (256,), q4, 8, True) == GGMLType.F32


@pytest.fixture(scope="module")
def kquant_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kquants")
    write_gguf(root / "tiny.gguf", "llama", KQUANT_DIMS)
    return import_gguf(root / "tiny.gguf", root / "tiny", progress=False)


@pytest.mark.parametrize("type_name, file_type", [("q4_k_m", 15), ("q5_k_m", 17), ("q6_k", 18)])
def test_a_k_quant_export_is_the_mix_and_transformers_reads_it(kquant_folder, tmp_path, type_name, file_type):
    from transformers import AutoModelForCausalLM

    exported = export_gguf(kquant_folder, tmp_path / f"tiny.{type_name}.gguf", type_name, progress=False)
    written = read_gguf(exported)
    assert written.metadata["general.file_type"] == file_type
    asked = {"q4_k_m": GGMLType.Q4_K, "q5_k_m": GGMLType.Q5_K, "q6_k": GGMLType.Q6_K}[type_name]
    for name, tensor in written.tensors.items():
        assert tensor.ggml_type == tensor_type(name, tensor.shape, asked, 8, True), name
    kinds = {tensor.ggml_type for tensor in written.tensors.values()}
    assert kinds == ({GGMLType.F32, GGMLType.Q6_K} | {asked}), kinds
    # imported back, every matrix is its float32 one within its type's bound
    back = import_gguf(exported, tmp_path / "back", progress=False)
    original, decoded = (StoredFolder(folder).dense_tensors() for folder in (kquant_folder, back))
    architecture = architecture_of(written)
    for name, tensor in written.tensors.items():
        if tensor.ggml_type in K_TYPES:  # Q/K rows reordered whole: each row is one block here
            hf_name = architecture.hf_name(name)
            assert_within_one_step(original[hf_name], decoded[hf_name], tensor.ggml_type)
    # transformers dequantises the file with gguf's decoders, and runs the model we run
    reference = AutoModelForCausalLM.from_pretrained(exported.parent, gguf_file=exported.name, dtype=torch.float32)
    ids = np.random.default_rng(3).integers(0, 96, (1, 12))
    with torch.no_grad():
        theirs = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_model(back).forward(ids), theirs, rtol=1e-4, atol=1e-4)


# -- llama.cpp itself


def llama_cpp_library(name: str) -> ctypes.CDLL:
    llama_cpp = llama_cpp_module()
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / f"lib{name}.so"))


@pytest.mark.parametrize("ggml_type", (*K_TYPES, GGMLType.Q5_0, GGMLType.Q5_1), ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_the_bytes_are_llama_cpps(ggml_type, kind):
    ggml = llama_cpp_library("ggml-base")
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    weight = values(kind, np.random.default_rng(10 + KINDS.index(kind))).astype(np.float32)
    ours = quantize(weight, ggml_type)
    theirs = np.zeros_like(ours)
    ggml.ggml_quantize_chunk(int(ggml_type), weight.ctypes.data, theirs.ctypes.data, 0,
                             weight.shape[0], weight.shape[1], None)
    np.testing.assert_array_equal(ours, theirs)
    assert FORMATS[ggml_type].block_bytes * weight.size // FORMATS[ggml_type].block_values == ours.size


def test_llama_quantize_of_our_f32_export_is_our_q4_k_m_export(kquant_folder, tmp_path):
    llama_cpp = llama_cpp_module()
    f32 = export_gguf(kquant_folder, tmp_path / "tiny.f32.gguf", "f32", progress=False)
    ours = export_gguf(kquant_folder, tmp_path / "tiny.q4_k_m.gguf", "q4_k_m", progress=False)
    theirs = tmp_path / "tiny.llama-quantize.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    ours, theirs = read_gguf(ours), read_gguf(theirs)
    assert ours.tensors.keys() == theirs.tensors.keys()
    for name, tensor in ours.tensors.items():
        assert tensor.ggml_type == theirs.tensors[name].ggml_type, name
        np.testing.assert_array_equal(tensor.data, theirs.tensors[name].data, err_msg=name)
