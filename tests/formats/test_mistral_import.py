"""Mistral (and Llama 2) GGUFs: a llama-architecture file with a SentencePiece vocabulary that puts
a space in front of the text.

llama.cpp converts MistralForCausalLM as `llama` (conversion/llama.py) and keeps no sliding
window for that architecture (its llama model reads none), so a Mistral GGUF is a llama one and
runs with full attention, as llama.cpp runs it; `MistralForCausalLM` with no sliding window
(Mistral 7B v0.2 and later) computes the same. References: transformers' tokenizer built from the
same GGUF (and llama.cpp's, where llama-cpp-python is installed), MistralForCausalLM on the
folder's tensors, and transformers' chat template rendering.
"""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import numpy as np
import pytest
import torch

from pyml.formats.chat_template import ChatTemplate
from pyml.formats.gguf_import import import_gguf
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.decoding import load_model, load_tokenizer
from tests.support.llama_cpp_reference import llama_cpp_module
from tests.support.model_folders import LLAMA, MISTRAL_TOKENS, write_gguf

TEXTS = [
    "the capital of France is Paris",
    " leading space, and  two  spaces",
    "line one\nline two\n\n  indented",
    "naïve café: ÉTÉ 2025 — ok?",
    "Pa Pa Pa the the",
    "",
]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(the GGUF, the folder `pyml import-gguf` made of it)."""
    root = tmp_path_factory.mktemp("mistral")
    gguf_path = root / "tiny-mistral.gguf"
    write_gguf(gguf_path, "llama", LLAMA, sentencepiece=True)
    return gguf_path, import_gguf(gguf_path, root / "tiny-mistral", progress=False)


def test_the_tokenizer_splits_and_joins_as_transformers_reading_the_gguf(mistral):
    from transformers import AutoTokenizer

    gguf_path, folder = mistral
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = load_tokenizer(folder)
    for text in TEXTS:
        expected = reference(text)["input_ids"]
        assert expected[0] == 1  # <s>, as add_bos_token says
        assert ours.decode(ours.encode(text).ids[1:]) == text, text
        if not text.startswith(" "):
            assert ours.encode(text).ids == expected, text
            assert ours.decode(expected[1:]) == reference.decode(expected[1:]) == text, text
    # Text that starts with a space: SentencePiece (add_dummy_prefix) and llama.cpp put the prefix
    # in front of it all the same ("▁▁leading"); transformers' GGUF tokenizer (a Metaspace that
    # prepends only to text not starting with one) does not. We tokenise as llama.cpp.
    space = MISTRAL_TOKENS.index("▁")
    assert ours.encode(" leading").ids[:3] == [1, space, space]


def test_the_tokenizer_splits_as_llama_cpp(mistral):
    llama_cpp = llama_cpp_module()
    gguf_path, folder = mistral
    reference = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    ours = load_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text).ids == reference.tokenize(text.encode(), add_bos=True, special=True), text


def test_the_chat_template_renders_as_transformers(mistral):
    from transformers import AutoTokenizer

    gguf_path, folder = mistral
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And Italy?"}]
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    rendered = ChatTemplate.of_folder(folder).render(messages, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>[INST] Capital of France? [/INST]Paris.</s>[INST]")


def test_logits_equal_mistral_for_causal_lm_on_the_folders_tensors(mistral, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    _, folder = mistral
    llama = json.loads((folder / "config.json").read_text())
    config = MistralConfig(
        vocab_size=len(MISTRAL_TOKENS), hidden_size=llama["hidden_size"],
        intermediate_size=llama["intermediate_size"], num_hidden_layers=llama["num_hidden_layers"],
        num_attention_heads=llama["num_attention_heads"], num_key_value_heads=llama["num_key_value_heads"],
        head_dim=llama["head_dim"], max_position_embeddings=llama["max_position_embeddings"],
        rms_norm_eps=llama["rms_norm_eps"], rope_theta=llama["rope_theta"], sliding_window=None,
        tie_word_embeddings=llama["tie_word_embeddings"])
    reference = MistralForCausalLM(config).eval()
    weights = {name: torch.tensor(value) for name, value in StoredFolder(folder).dense_tensors().items()}
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the head is tied
    ids = np.random.default_rng(0).integers(0, len(MISTRAL_TOKENS), (2, 20))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_model(folder).forward(ids), expected, rtol=1e-4, atol=1e-5)


def test_the_export_imports_back_with_the_same_tokenizer_and_tensors(mistral, tmp_path):
    from pyml.formats.gguf_export import export_gguf

    _, folder = mistral
    back = import_gguf(export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False), tmp_path / "back",
                       progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (back / name).read_text() == (folder / name).read_text(), name
    original, again = (StoredFolder(f).dense_tensors() for f in (folder, back))
    for name in original:
        np.testing.assert_array_equal(original[name], again[name], err_msg=name)
