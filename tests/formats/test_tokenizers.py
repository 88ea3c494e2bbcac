"""Our tokenizer of each shipped GGUF against transformers' tokenizer loaded from the same GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), the independent implementation.

Each family has one known difference, on purpose, and the reference ids are transformers' ids for
the text cut where it lies, concatenated (exactly transformers' own ids for text without it):

- SmolLM2 (GPT-2 BPE): llama.cpp's "smollm" pre-tokenizer first isolates every digit (`\\p{N}`) and
  only then applies the GPT-2 word regex, as SmolLM2's own tokenizer.json does
  (`Digits(individual_digits=True)` before `ByteLevel`). transformers' GGUF loader applies the
  GPT-2 regex alone, so whitespace in front of a digit tokenizes differently there ("    1" gives
  "ĠĠĠ", "Ġ", "1" instead of "ĠĠĠĠ", "1"): the text is cut at each digit.
- Gemma 3 (SentencePiece BPE): a run of more than 31 spaces. The file lists the runs of 2 to 31
  spaces as user-defined tokens, which llama.cpp and SentencePiece match whole in the text, longest
  first, as we do: 40 spaces become the 31-space token, then the 9-space one. transformers respells
  those tokens as runs of "▁" and reaches them through BPE merges, which cut 40 spaces into 16 + 24:
  the text is cut after every 31st space of a run.
"""

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pyml.formats.gguf_read import read_gguf
from pyml.formats.tokenizer import build_tokenizer
from tests.support.families import FAMILIES, Family
from tests.support.text_samples import TEXTS, VARIED_TEXT

SOURCE_FILES = sorted((Path(__file__).resolve().parents[2] / "pyml").rglob("*.py"))
LONGEST_SPACE_TOKEN = 31


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


def split_long_space_runs(text: str) -> list[str]:
    """Cut `text` after every 31st space of a run of spaces."""
    pieces, start = [], 0
    for run in re.finditer(" {%d,}" % (LONGEST_SPACE_TOKEN + 1), text):
        for cut in range(run.start() + LONGEST_SPACE_TOKEN, run.end(), LONGEST_SPACE_TOKEN):
            pieces.append(text[start:cut])
            start = cut
    return pieces + [text[start:]]


@dataclass(frozen=True)
class Tokenization:
    """What each family's tokenizer must do beyond the reference's ids."""

    special: list[str]  # text with the family's special tokens, added to the shared sample
    pieces: Callable[[str], list[str]]  # where transformers' GGUF tokenizer is cut (above)
    more_random_text: st.SearchStrategy  # what the shared random text lacks for this family
    vocab_size: int


TOKENIZATIONS = {
    "smollm2": Tokenization(
        special=[
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "<|endoftext|>",
            "text<|im_end|>text<|im_start|>",
            "<repo_name>pyml<file_sep>pyml/cli.py\nimport typer",
            "<|im_start|><|im_start|> <|im_end|>",
        ],
        pieces=split_at_digits,
        more_random_text=st.nothing(),
        vocab_size=49152,
    ),
    "gemma3": Tokenization(
        special=[
            "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
            "<bos>text<eos>",
            "<pad><unk><mask>[multimodal]<start_of_image><end_of_image>",
            "<unused0> <unused6241>",
            "<table><tr><td>1</td></tr></table> <h1>Title</h1><div>x</div>",
            "<0x41> is how the byte token for A is spelt, but text spells it as text",
            "tabs\t\t\t\tand\n\n\n\nnewlines",
        ] + [" " * n + "x" for n in (2, 3, 16, 30, 31, 32, 33, 40, 62, 63, 64, 100)]
          + ["a" + " " * n + "b" for n in (2, 5, 31, 32, 45)]
          + ["\t" * 40 + "y", "\n" * 40 + "y", " \t \n " * 10, "x" + " " * 31 + "\t" + " " * 33],
        pieces=split_long_space_runs,
        more_random_text=st.lists(
            st.sampled_from([" " * 20, " " * 33, " ", "\t", "\n", "a", "bc", "é", "<bos>"]), max_size=12
        ).map("".join),
        vocab_size=262144,
    ),
}
assert TOKENIZATIONS.keys() == FAMILIES.keys()


@dataclass
class Tokenizers:
    family: Family
    ours: Tokenizer
    reference: object
    tokenization: Tokenization

    def __repr__(self) -> str:  # a short name in hypothesis' failure reports
        return f"Tokenizers({self.family.name})"

    @property
    def sample(self) -> list[str]:
        return TEXTS + self.tokenization.special

    def reference_ids(self, text: str) -> list[int]:
        return [token for piece in self.tokenization.pieces(text)
                for token in self.reference(piece, add_special_tokens=False)["input_ids"]]

    def assert_matches_reference(self, text: str) -> None:
        ours, reference = self.ours, self.reference
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == self.reference_ids(text), repr(text)
        if self.spells(text):
            assert ours.decode(ids, skip_special_tokens=False) == self.spelt(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip), repr(text)

    def spells(self, text: str) -> bool:
        """Whether every UTF-8 byte of `text` has a token. Gemma's byte fallback spells every
        character; SmolLM2's vocabulary lacks 21 of the 256 byte tokens (controls like 0x04 and
        0x16, and bytes like 0xF5..0xFF that UTF-8 never uses)."""
        if self.family.name != "smollm2":
            return True
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        spelling = bytes_to_unicode()
        return all(self.ours.token_to_id(spelling[byte]) is not None for byte in text.encode("utf-8"))

    def spelt(self, text: str) -> str:
        # SentencePiece writes a space as "▁", so a "▁" in the text decodes as a space
        return text.replace("\u2581", " ") if self.family.name == "gemma3" else text


@pytest.fixture(scope="session")
def all_tokenizers(request, tmp_path_factory) -> dict[str, Tokenizers]:
    """Each family's tokenizers, built once: ours through tokenizer.json, as a user of the imported
    folder gets it, and transformers' from the same GGUF (tests/conftest.py)."""
    built = {}
    for name, family in FAMILIES.items():
        path = tmp_path_factory.mktemp(f"{name}_tokenizer") / "tokenizer.json"
        build_tokenizer(read_gguf(family.shipped_gguf())).save(str(path))
        reference = request.getfixturevalue(family.reference_tokenizer_fixture)
        built[name] = Tokenizers(family, Tokenizer.from_file(str(path)), reference, TOKENIZATIONS[name])
    return built


@pytest.fixture(scope="session", params=list(FAMILIES))
def tokenizers(request, all_tokenizers) -> Tokenizers:
    return all_tokenizers[request.param]


@pytest.fixture(scope="session")
def smollm2(all_tokenizers) -> Tokenizers:
    return all_tokenizers["smollm2"]


@pytest.fixture(scope="session")
def gemma3(all_tokenizers) -> Tokenizers:
    return all_tokenizers["gemma3"]


# -- every family

@pytest.mark.parametrize("family, text", [(name, text) for name, tokenization in TOKENIZATIONS.items()
                                          for text in TEXTS + tokenization.special])
def test_sample_matches_reference(all_tokenizers, family, text):
    all_tokenizers[family].assert_matches_reference(text)


@pytest.mark.parametrize("path", SOURCE_FILES, ids=lambda path: path.name)
def test_pyml_source_files_match_reference(tokenizers, path):
    tokenizers.assert_matches_reference(path.read_text(encoding="utf-8"))


def test_text_the_reference_is_not_cut_in_gives_exactly_its_ids(tokenizers):
    whole = [text for text in tokenizers.sample if len(tokenizers.tokenization.pieces(text)) <= 1]
    assert len(whole) >= 25
    for text in whole:
        expected = tokenizers.reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizers.ours.encode(text, add_special_tokens=False).ids == expected, repr(text)


def test_special_tokens_are_those_of_the_reference(tokenizers):
    added = {i: (t.content, t.special) for i, t in tokenizers.ours.get_added_tokens_decoder().items()}
    expected = {i: (t.content, t.special) for i, t in tokenizers.reference.added_tokens_decoder.items()}
    if tokenizers.family.name == "gemma3":
        # transformers lists the space runs as "▁" tokens of the vocabulary instead (see above)
        expected |= {i: (" " * n, False) for i, n in zip(range(138, 168), range(2, 32))}
    assert added == expected
    vocab_size = tokenizers.tokenization.vocab_size
    assert tokenizers.ours.get_vocab_size() == tokenizers.reference.vocab_size == vocab_size


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_text_matches_reference(tokenizers, data):
    text = data.draw(VARIED_TEXT | tokenizers.tokenization.more_random_text, label="text")
    tokenizers.assert_matches_reference(text)


# -- SmolLM2

def test_smollm2_every_digit_is_its_own_token_even_after_whitespace(smollm2):
    assert smollm2.ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    # llama.cpp's "smollm" split: the spaces stay one word, the digit is cut off.
    assert smollm2.ours.encode("    1").tokens == ["ĠĠĠĠ", "1"]
    assert smollm2.ours.encode("x = 42").tokens == ["x", "Ġ=", "Ġ", "4", "2"]


def test_smollm2_bytes_without_a_token_are_dropped_as_by_the_reference(smollm2):
    assert not smollm2.spells("\x16")
    assert smollm2.ours.encode("a\x16b").tokens == ["a", "b"]
    smollm2.assert_matches_reference("a\x04\x06\x13\x14\x16\x1db")


def test_smollm2_special_tokens_are_whole_and_special(smollm2):
    encoding = smollm2.ours.encode("<|im_start|>user\nHi<|im_end|>")
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert smollm2.ours.decode(encoding.ids, skip_special_tokens=True) == "user\nHi"


def test_smollm2_chat_prompt_matches_reference(smollm2):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of   Italy?\n\n  Thanks!"},
    ]
    reference = smollm2.reference
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert smollm2.ours.encode(prompt, add_special_tokens=False).ids == list(expected["input_ids"])


# -- Gemma 3

def test_splitting_long_space_runs():
    assert split_long_space_runs("a" + " " * 70 + "b") == ["a" + " " * 31, " " * 31, " " * 8 + "b"]
    assert split_long_space_runs(" " * 31 + "x") == [" " * 31 + "x"]


def test_gemma3_text_without_long_space_runs_gives_the_reference_ids_with_bos_too(gemma3):
    ordinary = [text for text in gemma3.sample if len(split_long_space_runs(text)) == 1]
    assert len(ordinary) >= 40
    for text in ordinary:
        expected = gemma3.reference(text, add_special_tokens=True)["input_ids"]
        assert gemma3.ours.encode(text, add_special_tokens=True).ids == expected, repr(text)


def test_gemma3_long_space_runs_take_the_longest_space_token_first(gemma3):
    ours, reference = gemma3.ours, gemma3.reference
    spaces = {n: ours.token_to_id(" " * n) for n in (1, 9, 31)}
    assert spaces[1] is None  # one space is "▁", part of the next piece
    assert ours.encode(" " * 40 + "x", add_special_tokens=False).ids == [
        spaces[31], spaces[9], ours.token_to_id("x")
    ]
    assert ours.encode(" " * 32 + "x", add_special_tokens=False).tokens == [" " * 31, "▁x"]
    # transformers: 16 + 24 spaces.
    assert reference(" " * 40 + "x", add_special_tokens=False)["input_ids"] == [
        reference.convert_tokens_to_ids("▁" * 16),
        reference.convert_tokens_to_ids("▁" * 24),
        reference.convert_tokens_to_ids("x"),
    ]


def test_gemma3_bos_is_added_as_the_reference_adds_it(gemma3):
    for text in ("The capital of France is", "", "<start_of_turn>user\nHi"):
        expected = gemma3.reference(text)["input_ids"]
        assert expected[0] == 2
        assert gemma3.ours.encode(text).ids == expected, repr(text)


def test_gemma3_special_tokens_include_the_turn_markers(gemma3):
    added = gemma3.ours.get_added_tokens_decoder().values()
    assert {token.content for token in added if token.special} >= {
        "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"
    }
