"""Importing a gemma3 GGUF as a Hugging Face folder with its spec.

Reference: Hugging Face transformers loading the same GGUF (`from_pretrained(dir, gguf_file=...)`
gives a `Gemma3ForCausalLM`), an independent implementation of the format, the dequantisers, the
norm-weight convention (the file holds 1 + w; transformers subtracts 1) and the config. Our
tensors must equal its tensors, our config.json its config, and the folder we write must load in
transformers and give the same logits. The real model is the shipped Gemma 3 270M (Q4_K_M),
checked with the other families' in test_shipped_imports.py and here for what only Gemma has; a
tiny gemma3 GGUF written here with the gguf package covers what the real file cannot: other
dims, other tensor types, and every way the file can disagree with what a gemma3 model is.
"""

import itertools
import json
import os
import tomllib
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from pyml.errors import PymlError
from pyml.formats.gguf_import import import_gguf
from pyml.formats.stored_tensors import StoredFolder
from tests.support.model_folders import transformers_folder

GGMLType = gguf.GGMLQuantizationType
PROMPT = "The capital of France is"


def transformers_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def transformers_from_folder(folder: Path):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32).eval()


# -- the real model (imported once, tests/conftest.py; what every family shares is checked in
# test_shipped_imports.py)


def test_the_tokenizer_config_adds_bos_and_has_no_chat_template(gemma3_dir):
    tokenizer_config = json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is True and "chat_template" not in tokenizer_config


def test_folder_tokenizer_gives_the_ids_of_the_gguf_tokenizer(gemma3_dir, gemma3_reference_tokenizer):
    from transformers import AutoTokenizer

    reference_tokenizer = gemma3_reference_tokenizer
    ours = AutoTokenizer.from_pretrained(gemma3_dir)
    for text in (PROMPT, "", "  two spaces, <start_of_turn>user\n日本語 🎉<end_of_turn>"):
        assert ours(text)["input_ids"] == reference_tokenizer(text)["input_ids"], repr(text)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<bos>", "<eos>", "<pad>", "<unk>"
    )


# -- a tiny gemma3 GGUF written with the gguf package

# head_dim 256 as in every Gemma 3: transformers' GGUF loader scales the scores by 256 ** -0.5
# whatever the head size, llama.cpp (and we) by head_dim ** -0.5 (see the test of the scale).
TINY = {"hidden": 64, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 256, "ffn": 128}
TINY_WINDOW = 4
TINY_PIECES = ["▁", "a", "b", "▁a", "ab", "▁ab", "ba", "▁b"]
TINY_TOKENS = (
    ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{byte:02X}>" for byte in range(256)] + TINY_PIECES
)
NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
         "post_ffw_norm")
QUANTISED_TYPES = [GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_1, GGMLType.F16, GGMLType.BF16,
                   GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.F32]


def tiny_shapes(**dims: int) -> dict[str, tuple[int, ...]]:
    """The tensors of the tiny model (of TINY's dims but `dims`), GGUF names, Hugging Face layout."""
    dims = TINY | dims
    hidden, ffn, head_dim = dims["hidden"], dims["ffn"], dims["head_dim"]
    q_rows, kv_rows = dims["heads"] * head_dim, dims["kv_heads"] * head_dim
    shapes = {"token_embd.weight": (len(TINY_TOKENS), hidden), "output_norm.weight": (hidden,)}
    for layer in range(dims["layers"]):
        shapes |= {
            f"blk.{layer}.attn_norm.weight": (hidden,),
            f"blk.{layer}.attn_q.weight": (q_rows, hidden),
            f"blk.{layer}.attn_k.weight": (kv_rows, hidden),
            f"blk.{layer}.attn_v.weight": (kv_rows, hidden),
            f"blk.{layer}.attn_q_norm.weight": (head_dim,),
            f"blk.{layer}.attn_k_norm.weight": (head_dim,),
            f"blk.{layer}.attn_output.weight": (hidden, q_rows),
            f"blk.{layer}.post_attention_norm.weight": (hidden,),
            f"blk.{layer}.ffn_norm.weight": (hidden,),
            f"blk.{layer}.ffn_gate.weight": (ffn, hidden),
            f"blk.{layer}.ffn_up.weight": (ffn, hidden),
            f"blk.{layer}.ffn_down.weight": (hidden, ffn),
            f"blk.{layer}.post_ffw_norm.weight": (hidden,),
        }
    return shapes


def is_norm(name: str) -> bool:
    return name.split(".")[-2] in NORMS or name == "output_norm.weight"


def write_tiny_gemma3_gguf(
    path: Path,
    shapes: dict[str, tuple[int, ...]] | None = None,
    metadata: dict[str, object] | None = None,
    types: dict[str, GGMLType] | None = None,
    dims: dict[str, int] | None = None,
) -> None:
    """Write a tiny gemma3 GGUF as llama.cpp's converter does (norms stored as 1 + w), its
    matrices in the types gguf can quantise. `dims` overrides TINY's, `shapes` the tensors,
    `metadata` overrides or adds gemma3.* keys (None drops one)."""
    dims = TINY | (dims or {})
    shapes = tiny_shapes(**dims) if shapes is None else shapes
    matrices = [name for name in shapes if not is_norm(name)]
    types = dict(zip(matrices, itertools.cycle(QUANTISED_TYPES))) | (types or {})
    writer = gguf.GGUFWriter(path, "gemma3")
    keys: dict[str, object] = {
        "context_length": 64,
        "embedding_length": dims["hidden"],
        "block_count": dims["layers"],
        "feed_forward_length": dims["ffn"],
        "attention.head_count": dims["heads"],
        "attention.head_count_kv": dims["kv_heads"],
        "attention.key_length": dims["head_dim"],
        "attention.value_length": dims["head_dim"],
        "attention.sliding_window": TINY_WINDOW,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1e6,
    } | (metadata or {})
    for key, value in keys.items():
        if isinstance(value, float):
            writer.add_float32(f"gemma3.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"gemma3.{key}", value)
        elif value is not None:
            writer.add_uint32(f"gemma3.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(TINY_PIECES))])
    writer.add_token_types([3] * 4 + [6] * 256 + [1] * len(TINY_PIECES))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    rng = np.random.default_rng(3)
    for name, shape in shapes.items():
        weight = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if is_norm(name):
            writer.add_tensor(name, weight + np.float32(1))  # Gemma's gain 1 + w, as llama.cpp stores it
            continue
        encoded = reference_quantize(weight, types[name])
        raw_dtype = None if types[name] in (GGMLType.F32, GGMLType.F16) else types[name]
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_model_equals_transformers_loading_it(tmp_path):
    write_tiny_gemma3_gguf(tmp_path / "tiny.gguf")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny-gemma", progress=False)
    reference = transformers_from_gguf(tmp_path / "tiny.gguf")
    ours = transformers_from_folder(tmp_path / "tiny-gemma")
    theirs = reference.state_dict()
    written = StoredFolder(tmp_path / "tiny-gemma").dense_tensors()
    assert set(written) | {"lm_head.weight"} == set(theirs)
    for name, weight in written.items():
        assert np.array_equal(weight, theirs[name].numpy()), name
    assert ours.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    for field in ("sliding_window", "rope_parameters", "head_dim", "query_pre_attn_scalar"):
        assert getattr(ours.config, field) == getattr(reference.config, field), field
    # Longer than the window of 4, so the sliding layers drop the start.
    tokens = torch.tensor([[2, 260, 261, 262, 263, 264, 265, 100, 266, 267, 1]])
    with torch.no_grad():
        assert torch.equal(ours(tokens).logits, reference(tokens).logits)


def test_tiny_model_decodes_every_tensor_and_subtracts_one_from_the_norms(tmp_path):
    write_tiny_gemma3_gguf(tmp_path / "tiny.gguf")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    written = StoredFolder(tmp_path / "out").dense_tensors()
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    assert {t.tensor_type for t in reader.tensors} == set(QUANTISED_TYPES)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        stored = reference_dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        expected = stored - np.float32(1) if is_norm(tensor.name) else stored
        assert np.array_equal(written[hf_name(tensor.name)], expected), tensor.name


HF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(gguf_name: str) -> str:
    """Gemma3ForCausalLM's name of a GGUF tensor (transformers' modeling_gemma3.py)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, within, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_BLOCK_NAMES[within]}.weight"


def test_tiny_spec_follows_the_metadata(tmp_path):
    write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", metadata={"attention.sliding_window": 7})
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "Tiny-Gemma.v2", progress=False)
    with open(tmp_path / "Tiny-Gemma.v2" / "spec.toml", "rb") as handle:
        spec = tomllib.load(handle)
    assert spec["name"] == "tiny_gemma_v2"
    attention = spec["block"]["layers"][0]["body"][1]
    assert attention["pattern"] == [{"window": 7, "rope_theta": 10000.0}] * 5 + [{}]
    assert (attention["dim"], attention["n_heads"], attention["head_dim"]) == (64, 2, 256)
    assert "scale" not in attention  # 1 / sqrt(head_dim), the default
    assert spec["embedding"] == {"vocab_size": len(TINY_TOKENS), "dim": 64, "scale": 8.0}
    assert spec["block"]["count"] == 6 and spec["max_seq_len"] == 64


def test_scores_are_scaled_as_llama_cpp_scales_them(tmp_path):
    """llama.cpp scales gemma3's scores by 1 / sqrt(head_dim), but for the 27B model (62 layers)
    by 1 / sqrt(hidden / heads), as Google's configs do (query_pre_attn_scalar); the file states
    neither. transformers' GGUF loader takes 256 for every file, which agrees for Gemma 3's
    head_dim of 256 but not here: this is where we follow llama.cpp instead."""
    for layers, scalar in ((6, 48), (62, TINY["hidden"] // TINY["heads"])):
        dims = {"layers": layers, "head_dim": 48}
        write_tiny_gemma3_gguf(tmp_path / f"{layers}.gguf", dims=dims)
        out = import_gguf(tmp_path / f"{layers}.gguf", tmp_path / f"out{layers}", progress=False)
        assert json.loads((out / "config.json").read_text())["query_pre_attn_scalar"] == scalar
        with open(out / "spec.toml", "rb") as handle:
            attention = tomllib.load(handle)["block"]["layers"][0]["body"][1]
        assert attention.get("scale", 48**-0.5) == scalar**-0.5
        assert ("scale" in attention) == (layers == 62)


def without(name: str) -> dict[str, tuple[int, ...]]:
    return {key: shape for key, shape in tiny_shapes().items() if key != name}


@pytest.mark.parametrize(
    "shapes, metadata, message",
    [
        (without("blk.3.post_ffw_norm.weight"), {},
         "missing tensors 'blk.3.post_ffw_norm.weight' of a gemma3 model"),
        (tiny_shapes() | {"blk.0.attn_q_norm.weight": (64,)}, {},
         r"'blk.0.attn_q_norm.weight': expected shape \(256,\), observed \(64,\)"),
        (tiny_shapes() | {"output.weight": (len(TINY_TOKENS), 32)}, {},
         r"'output.weight': expected shape \(268, 64\), observed \(268, 32\)"),
        (tiny_shapes(), {"attention.sliding_window": None},
         "gemma3.attention.sliding_window is None, not a positive integer"),
        (tiny_shapes(), {"rope.scaling.type": "linear"},
         r"rope scaling is not supported \(gemma3.rope.scaling.type is 'linear'\)"),
        (tiny_shapes(), {"final_logit_softcapping": 30.0},
         "final logit soft-capping is not supported"),
        (tiny_shapes(), {"attention.head_count_kv": 3}, "2 heads do not share 3 key/value heads"),
        (tiny_shapes(), {"attention.key_length": 47, "attention.value_length": 47},
         "head size 47 is odd"),
        (tiny_shapes(), {"embedding_length": 0}, "gemma3.embedding_length is 0"),
    ],
)
def test_files_that_are_no_gemma3_model_are_named(tmp_path, shapes, metadata, message):
    types = {name: GGMLType.F32 for name in shapes}
    write_tiny_gemma3_gguf(tmp_path / "bad.gguf", shapes=shapes, metadata=metadata, types=types)
    with pytest.raises(PymlError, match=message) as error:
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(error.value) and str(tmp_path / "bad.gguf") in str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_head_of_its_own_is_imported_untied(tmp_path):
    write_tiny_gemma3_gguf(
        tmp_path / "untied.gguf", shapes=tiny_shapes() | {"output.weight": (len(TINY_TOKENS), 64)}
    )
    import_gguf(tmp_path / "untied.gguf", tmp_path / "out", progress=False)
    assert "lm_head.weight" in StoredFolder(tmp_path / "out").dense_tensors()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    with open(tmp_path / "out" / "spec.toml", "rb") as handle:
        assert tomllib.load(handle)["lm_head"]["tied"] is False
