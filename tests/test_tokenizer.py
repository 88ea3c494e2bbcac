"""Our tokenizer built from the SmolLM2 GGUF against transformers' tokenizer loaded from the same
GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), the independent implementation.

One known difference, on purpose: llama.cpp's "smollm" pre-tokenizer first isolates every digit
(`\\p{N}`) and only then applies the GPT-2 word regex, as SmolLM2's own tokenizer.json does
(`Digits(individual_digits=True)` before `ByteLevel`). transformers' GGUF loader applies the GPT-2
regex alone, so whitespace in front of a digit tokenizes differently there ("    1" gives
"ĠĠĠ", "Ġ", "1" instead of "ĠĠĠĠ", "1"). The reference ids are therefore transformers' ids for the
text cut at each digit, concatenated: exactly transformers' own ids for text without digits.
"""

import os
import unicodedata
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import pytest
from hypothesis import given, settings
from text_samples import TEXTS, VARIED_TEXT
from tokenizers import Tokenizer

from pyml.formats.gguf_read import read_gguf
from pyml.formats.smollm2_gguf import shipped_gguf_path
from pyml.formats.tokenizer import build_tokenizer

SPECIAL = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>text<|im_start|>",
    "<repo_name>pyml<file_sep>pyml/cli.py\nimport typer",
    "<|im_start|><|im_start|> <|im_end|>",
]
SAMPLE = TEXTS + SPECIAL
SOURCE_FILES = sorted((Path(__file__).parents[1] / "pyml").rglob("*.py"))


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Tokenizer:
    # Through tokenizer.json, as a user of the imported directory gets it.
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    build_tokenizer(read_gguf(shipped_gguf_path())).save(str(path))
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    gguf_path = shipped_gguf_path()
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def split_at_digits(text: str) -> list[str]:
    """Cut `text` around every character of Unicode category N, as llama.cpp's `\\p{N}` does."""
    pieces, current = [], ""
    for char in text:
        if unicodedata.category(char).startswith("N"):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return pieces + [current] if current else pieces


def reference_ids(reference, text: str) -> list[int]:
    return [
        token
        for piece in split_at_digits(text)
        for token in reference(piece, add_special_tokens=False)["input_ids"]
    ]


def spellable(ours: Tokenizer, text: str) -> bool:
    """Whether every UTF-8 byte of `text` has a token: SmolLM2's vocabulary lacks 21 of the 256
    byte tokens (controls like 0x04 and 0x16, and bytes like 0xF5..0xFF that UTF-8 never uses)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return all(ours.token_to_id(spelling[byte]) is not None for byte in text.encode("utf-8"))


def assert_matches_reference(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference_ids(reference, text), repr(text)
    if spellable(ours, text):
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(
        ids, skip_special_tokens=False
    )
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("text", SAMPLE)
def test_sample_matches_reference(ours, reference, text):
    assert_matches_reference(ours, reference, text)


@pytest.mark.parametrize("path", SOURCE_FILES, ids=lambda path: path.name)
def test_pyml_source_files_match_reference(ours, reference, path):
    assert_matches_reference(ours, reference, path.read_text(encoding="utf-8"))


def test_text_without_digits_gives_exactly_the_reference_ids(ours, reference):
    digit_free = [text for text in SAMPLE if len(split_at_digits(text)) <= 1]
    assert len(digit_free) >= 25
    for text in digit_free:
        expected = reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == expected, repr(text)


def test_every_digit_is_its_own_token_even_after_whitespace(ours):
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    # llama.cpp's "smollm" split: the spaces stay one word, the digit is cut off.
    assert ours.encode("    1").tokens == ["ĠĠĠĠ", "1"]
    assert ours.encode("x = 42").tokens == ["x", "Ġ=", "Ġ", "4", "2"]


def test_bytes_without_a_token_are_dropped_as_by_the_reference(ours, reference):
    assert not spellable(ours, "\x16")
    assert ours.encode("a\x16b").tokens == ["a", "b"]
    assert_matches_reference(ours, reference, "a\x04\x06\x13\x14\x16\x1db")


def test_special_tokens_are_whole_and_special(ours, reference):
    encoding = ours.encode("<|im_start|>user\nHi<|im_end|>")
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert ours.decode(encoding.ids, skip_special_tokens=True) == "user\nHi"
    added = ours.get_added_tokens_decoder()
    expected = reference.added_tokens_decoder
    assert {i: (t.content, t.special) for i, t in added.items()} == {
        i: (t.content, t.special) for i, t in expected.items()
    }
    assert ours.get_vocab_size() == reference.vocab_size == 49152


def test_chat_prompt_matches_reference(ours, reference):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of   Italy?\n\n  Thanks!"},
    ]
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ours.encode(prompt, add_special_tokens=False).ids == list(expected["input_ids"])


class Both:
    """Both tokenizers, under a short name in hypothesis' failure reports."""

    def __init__(self, ours, reference):
        self.ours, self.reference = ours, reference

    def __repr__(self) -> str:
        return "Both(ours, reference)"


@pytest.fixture(scope="module")
def both(ours, reference) -> Both:
    return Both(ours, reference)


@settings(max_examples=300, deadline=None)
@given(text=VARIED_TEXT)
def test_random_text_matches_reference(both, text):
    assert_matches_reference(both.ours, both.reference, text)
