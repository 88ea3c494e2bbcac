"""The training corpus and data order: pydoc_data by default, split by document, packed windows
with EOS between documents, and batches whose saved state reproduces every later batch."""

import json

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.train.data import (
    Batches,
    Document,
    encode_documents,
    load_corpus,
    next_token_pairs,
    pack,
    split_documents,
    start_id,
)
from pyml.train.digits import load_digits_split

EOS = 255


def utf8_bytes(texts):
    return [list(text.encode("utf-8")) for text in texts]


def test_default_corpus_is_pydoc_topics_sorted_by_name():
    documents = load_corpus(None)
    assert 70 <= len(documents) <= 90  # 79 in CPython 3.11-3.13
    names = [document.name for document in documents]
    assert names == sorted(names)
    assert "assert" in names
    assert sum(len(document.text) for document in documents) > 300_000


def test_split_is_by_whole_document_and_deterministic():
    documents = load_corpus(None)
    train, held_out = split_documents(documents, held_out_fraction=0.1, seed=0)
    assert len(held_out) == round(0.1 * len(documents))
    assert set(train).isdisjoint(held_out)
    assert sorted(train + held_out, key=lambda d: d.name) == documents
    assert split_documents(documents, 0.1, seed=0) == (train, held_out)
    assert split_documents(documents, 0.1, seed=1) != (train, held_out)


def test_a_single_document_is_split_at_a_line_break():
    text = "".join(f"line {i}\n" for i in range(100))
    (train,), (held_out,) = split_documents([Document("notes.txt", text)], 0.1)
    assert train.text + held_out.text == text
    assert train.text.endswith("\n") and 5 <= held_out.text.count("\n") <= 15


def test_encoding_puts_eos_after_every_document_and_packing_makes_shifted_windows():
    documents = [Document("a", "abc"), Document("b", "de")]
    stream = encode_documents(documents, utf8_bytes, EOS)
    assert stream.tolist() == [97, 98, 99, EOS, 100, 101, EOS]
    windows = pack(stream, 3)
    assert windows.shape == (2, 4)  # (7 - 1) // 3 windows of 3 inputs + 1 target
    assert windows.tolist() == [[97, 98, 99, EOS], [EOS, 100, 101, EOS]]
    inputs, targets = next_token_pairs(windows)
    assert inputs.shape == targets.shape == (2, 3)
    assert (targets[:, :-1] == inputs[:, 1:]).all()


def test_with_a_start_id_every_window_begins_with_it_and_every_token_is_a_target_once():
    stream = np.arange(10, 20)
    windows = pack(stream, 3, start=1)
    assert windows.tolist() == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18]]
    inputs, targets = next_token_pairs(windows)
    assert (inputs[:, 0] == 1).all()
    assert targets.reshape(-1).tolist() == stream[:9].tolist()  # 19 waits for a window of its own
    with pytest.raises(PymlError, match="shorter --seq"):
        pack(np.arange(2), 3, start=1)


def test_the_start_id_is_what_the_tokenizer_puts_before_every_text():
    def framing_with(prefix):
        return lambda text, special: (prefix if special else []) + list(text.encode())

    assert start_id(framing_with([2])) == 2  # Gemma's <bos>
    assert start_id(framing_with([])) is None  # SmolLM2's tokenizer adds nothing


def test_pydoc_windows_have_the_requested_shape():
    stream = encode_documents(load_corpus(None)[:5], utf8_bytes, EOS)
    windows = pack(stream, 64)
    assert windows.shape == ((len(stream) - 1) // 64, 65)
    assert (windows == EOS).sum() >= 4  # the boundaries between the five documents


def test_too_little_text_for_one_window_is_refused():
    with pytest.raises(PymlError, match="shorter --seq"):
        pack(np.arange(10), 16)


def test_data_from_a_folder_and_from_a_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    (tmp_path / "sub" / "a.txt").write_text("A text\n", encoding="utf-8")
    (tmp_path / "c.rst").write_text("C\n", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    documents = load_corpus(tmp_path)
    assert [d.name for d in documents] == ["b.md", "c.rst", "sub/a.txt"]
    assert load_corpus(tmp_path / "b.md") == [Document(str(tmp_path / "b.md"), "# B\n")]


def test_text_suffixes_are_read_in_any_case(tmp_path):
    (tmp_path / "NOTES.TXT").write_text("Notes\n", encoding="utf-8")
    (tmp_path / "Guide.Md").write_text("# Guide\n", encoding="utf-8")
    assert [d.name for d in load_corpus(tmp_path)] == ["Guide.Md", "NOTES.TXT"]
    assert load_corpus(tmp_path / "NOTES.TXT") == [Document(str(tmp_path / "NOTES.TXT"), "Notes\n")]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "no such file or folder"),
        (   # a table is not prose: never trained on as if it were
            lambda root: (root / "chats.csv").write_text("q,a\nhi,hello\n") and root / "chats.csv",
            r"chats.csv: neither text \(.md, .rst, .txt\) nor examples \(.jsonl, .json\)",
        ),
        (
            lambda root: (root / "weights.bin").write_bytes(bytes(range(256))) and root / "weights.bin",
            r"weights.bin: neither text",
        ),
        (lambda root: root, "no text files"),
        (lambda root: (root / "empty.txt").write_text("  \n") and root / "empty.txt", "no text"),
        (
            lambda root: (root / "latin1.txt").write_bytes(b"caf\xe9") and root / "latin1.txt",
            "not UTF-8",
        ),
    ],
)
def test_bad_data_paths_are_refused(tmp_path, make, message):
    with pytest.raises(PymlError, match=message):
        load_corpus(make(tmp_path))


def test_batches_cover_an_epoch_without_repeats_and_restore_exactly():
    rows = np.arange(10)
    batches = Batches((rows, rows * 10), batch_size=3, seed=7)
    first_epoch = np.concatenate([batches.next_batch()[0] for _ in range(3)])
    assert len(set(first_epoch.tolist())) == 9  # the 10th row waits for a later epoch
    for _ in range(2):
        batches.next_batch()
    saved = json.loads(json.dumps(batches.state()))  # as a checkpoint's state.json keeps it
    expected = [batches.next_batch() for _ in range(7)]
    restored = Batches((rows, rows * 10), batch_size=3, seed=0)
    restored.load_state(saved)
    for want, got in zip(expected, [restored.next_batch() for _ in range(7)]):
        assert all((w == g).all() for w, g in zip(want, got))
    assert (expected[0][1] == expected[0][0] * 10).all()


def test_an_epoch_of_rows_a_whole_number_of_batches_is_used_up_exactly():
    rows = np.arange(12)
    batches = Batches((rows,), batch_size=4, seed=3)
    first_epoch = np.concatenate([batches.next_batch()[0] for _ in range(3)])
    assert sorted(first_epoch.tolist()) == rows.tolist() and batches.epoch == 0
    batches.next_batch()
    assert batches.epoch == 1


def test_batches_larger_than_the_data_are_refused():
    with pytest.raises(PymlError, match="smaller --batch"):
        Batches((np.arange(4),), batch_size=5, seed=0)


def test_digits_split_is_scaled_and_deterministic():
    (train_x, train_y), (held_x, held_y) = load_digits_split(held_out_fraction=0.2, seed=0)
    assert train_x.shape[1] == held_x.shape[1] == 64
    assert len(train_x) + len(held_x) == 1797 and len(held_x) == 359
    assert 0.0 <= train_x.min() and train_x.max() == 1.0
    assert set(np.unique(held_y).tolist()) == set(range(10))
    (again_x, _), _ = load_digits_split(held_out_fraction=0.2, seed=0)
    assert (again_x == train_x).all()
