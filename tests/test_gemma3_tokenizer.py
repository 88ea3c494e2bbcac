"""Our tokenizer built from the Gemma 3 GGUF (SentencePiece BPE, from the vocabulary, the scores and
the token kinds) against transformers' tokenizer loaded from the same GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), the independent implementation.

One known difference: a run of more than 31 spaces. The file lists the runs of 2 to 31 spaces as
user-defined tokens, which llama.cpp and SentencePiece match whole in the text, longest first, as
we do: 40 spaces become the 31-space token, then the 9-space one. transformers respells those tokens
as runs of "▁" and reaches them through BPE merges, which cut 40 spaces into 16 + 24. The reference
ids are therefore transformers' ids for the text cut after every 31st space of a run, concatenated:
exactly transformers' own ids for text without such runs.
"""

import os
import re
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from text_samples import TEXTS, VARIED_TEXT
from tokenizers import Tokenizer

from pyml.formats.gemma3_gguf import shipped_gguf_path
from pyml.formats.gguf_read import read_gguf
from pyml.formats.tokenizer import build_tokenizer

LONGEST_SPACE_TOKEN = 31
SPECIAL = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>",
    "<pad><unk><mask>[multimodal]<start_of_image><end_of_image>",
    "<unused0> <unused6241>",
    "<table><tr><td>1</td></tr></table> <h1>Title</h1><div>x</div>",
    "<0x41> is how the byte token for A is spelt, but text spells it as text",
    "tabs\t\t\t\tand\n\n\n\nnewlines",
]
WHITESPACE_RUNS = [
    " " * n + "x" for n in (2, 3, 16, 30, 31, 32, 33, 40, 62, 63, 64, 100)
] + [
    "a" + " " * n + "b" for n in (2, 5, 31, 32, 45)
] + ["\t" * 40 + "y", "\n" * 40 + "y", " \t \n " * 10, "x" + " " * 31 + "\t" + " " * 33]
SAMPLE = TEXTS + SPECIAL + WHITESPACE_RUNS
SOURCE_FILES = sorted((Path(__file__).parents[1] / "pyml").rglob("*.py"))


@pytest.fixture(scope="session")
def ours(tmp_path_factory) -> Tokenizer:
    # Through tokenizer.json, as a user of the imported folder gets it.
    path = tmp_path_factory.mktemp("gemma_tokenizer") / "tokenizer.json"
    build_tokenizer(read_gguf(shipped_gguf_path())).save(str(path))
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="session")
def reference():
    from transformers import AutoTokenizer

    gguf_path = shipped_gguf_path()
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def split_long_space_runs(text: str) -> list[str]:
    """Cut `text` after every 31st space of a run of spaces."""
    pieces, start = [], 0
    for run in re.finditer(" {%d,}" % (LONGEST_SPACE_TOKEN + 1), text):
        for cut in range(run.start() + LONGEST_SPACE_TOKEN, run.end(), LONGEST_SPACE_TOKEN):
            pieces.append(text[start:cut])
            start = cut
    return pieces + [text[start:]]


def reference_ids(reference, text: str, add_special_tokens: bool = False) -> list[int]:
    ids = [
        token
        for piece in split_long_space_runs(text)
        for token in reference(piece, add_special_tokens=False)["input_ids"]
    ]
    return [reference.bos_token_id] + ids if add_special_tokens else ids


def assert_matches_reference(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference_ids(reference, text), repr(text)
    # Byte fallback spells every character, so the text comes back, but for a "▁" in it: that is
    # how SentencePiece writes a space, so it decodes as one.
    assert ours.decode(ids, skip_special_tokens=False) == text.replace("\u2581", " ")
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_splitting_long_space_runs():
    assert split_long_space_runs("a" + " " * 70 + "b") == ["a" + " " * 31, " " * 31, " " * 8 + "b"]
    assert split_long_space_runs(" " * 31 + "x") == [" " * 31 + "x"]


@pytest.mark.parametrize("text", SAMPLE)
def test_sample_matches_reference(ours, reference, text):
    assert_matches_reference(ours, reference, text)


@pytest.mark.parametrize("path", SOURCE_FILES, ids=lambda path: path.name)
def test_pyml_source_files_match_reference(ours, reference, path):
    assert_matches_reference(ours, reference, path.read_text(encoding="utf-8"))


def test_text_without_long_space_runs_gives_exactly_the_reference_ids(ours, reference):
    ordinary = [text for text in SAMPLE if len(split_long_space_runs(text)) == 1]
    assert len(ordinary) >= 40
    for text in ordinary:
        for special in (False, True):
            expected = reference(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special).ids == expected, repr(text)


def test_long_space_runs_take_the_longest_space_token_first(ours, reference):
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


def test_bos_is_added_as_the_reference_adds_it(ours, reference):
    for text in ("The capital of France is", "", "<start_of_turn>user\nHi"):
        expected = reference(text)["input_ids"]
        assert expected[0] == 2
        assert ours.encode(text).ids == expected, repr(text)


def test_special_and_user_defined_tokens(ours, reference):
    added = {i: (t.content, t.special) for i, t in ours.get_added_tokens_decoder().items()}
    expected = {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    # transformers lists the space runs as "▁" tokens of the vocabulary instead (see above).
    space_runs = {i: (" " * n, False) for i, n in zip(range(138, 168), range(2, 32))}
    assert added == expected | space_runs
    assert {content for content, special in added.values() if special} >= {
        "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"
    }
    assert ours.get_vocab_size() == reference.vocab_size == 262144


@settings(max_examples=300, deadline=None)
@given(
    text=VARIED_TEXT
    | st.lists(st.sampled_from([" " * 20, " " * 33, " ", "\t", "\n", "a", "bc", "é", "<bos>"]),
               max_size=12).map("".join)
)
def test_random_text_matches_reference(ours, reference, text):
    assert_matches_reference(ours, reference, text)
