"""Llama 3's tokenizer ("llama-bpe"): the byte-level vocabulary cut by Llama 3's regex (runs of up
to three digits) with ignore_merges (a word that is a token of its own is that token).

References: llama.cpp's tokenizer on the same GGUF where llama-cpp-python is installed, and
transformers' tokenizer built from it; the tiny vocabulary holds a word and a run of digits that
no merge makes, which only those two rules reach whole.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import pytest

from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.generate.decoding import load_tokenizer
from tests.support.llama_cpp_reference import llama_cpp_module
from tests.support.model_folders import LLAMA, LLAMA3_TOKENS, write_gguf

TEXTS = [
    "The capital of France is Paris, and 12 and 7 are 19.",
    "capital capitals  capital\n1234567 apples, 123 pears",
    "it's 2025: ÉTÉ, naïve!\n\n  x\ty  ",
]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3-tokenizer")
    gguf_path = root / "tiny-llama3.gguf"
    write_gguf(gguf_path, "llama", LLAMA, pre="llama-bpe")
    return gguf_path, import_gguf(gguf_path, root / "tiny-llama3", progress=False)


def test_words_and_digit_runs_the_vocabulary_holds_are_one_token(llama3):
    _, folder = llama3
    ours = load_tokenizer(folder)
    assert ours.encode(" capital").ids == [LLAMA3_TOKENS.index("Ġcapital")]  # no merge makes it
    assert ours.encode("1234").ids == [LLAMA3_TOKENS.index("123"), LLAMA3_TOKENS.index("4")]


def test_the_tokenizer_splits_as_transformers_reading_the_gguf(llama3):
    from transformers import AutoTokenizer

    gguf_path, folder = llama3
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers' GGUF loader leaves out ignore_merges, which llama.cpp applies to "llama-bpe"
    # and Llama 3's own tokenizer.json sets: set on theirs, the regex, the byte-level mapping and
    # the merges are what is compared
    assert not reference.backend_tokenizer.model.ignore_merges
    reference.backend_tokenizer.model.ignore_merges = True
    ours = load_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text).ids == reference(text)["input_ids"], text
    for text in TEXTS[:2]:  # the third has characters the tiny vocabulary has no byte token for
        assert ours.decode(ours.encode(text).ids) == text


def test_the_tokenizer_splits_as_llama_cpp(llama3):
    llama_cpp = llama_cpp_module()
    gguf_path, folder = llama3
    reference = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    ours = load_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text).ids == reference.tokenize(text.encode(), add_bos=False, special=True), text


def test_the_export_names_the_pre_tokenizer_llama_bpe(llama3, tmp_path):
    _, folder = llama3
    exported = export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    assert read_gguf(exported).metadata["tokenizer.ggml.pre"] == "llama-bpe"
    back = import_gguf(exported, tmp_path / "back", progress=False)
    assert (back / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
