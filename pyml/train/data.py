"""Training text: a corpus read from disk, split by document, tokenised, packed and batched.

Nothing is downloaded. The default corpus is the Python reference documentation that ships inside
CPython itself (`pydoc_data.topics`: 79 topics, about 465 KB of English prose); `--data` takes a
text file or folder of text files instead (or examples, `pyml.train.examples`; a file that is
neither is refused, so that JSON or CSV is never trained on as if it were prose). Every step is
deterministic under a seed, and `Batches` exposes its whole state so a checkpoint can restore it
exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyml.errors import PymlError

TEXT_SUFFIXES = (".md", ".rst", ".txt")  # both kinds compared in lower case: NOTES.TXT is text
EXAMPLE_SUFFIXES = (".jsonl", ".json")  # what `pyml.train.examples` reads
DEFAULT_CORPUS_NAME = "pydoc_data (the Python reference documentation shipped with CPython)"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def load_corpus(data: Path | None) -> list[Document]:
    """The documents of `data` (a .txt/.md/.rst file, or a folder searched recursively for such
    files, sorted by path); with no `data`, the pydoc_data topics sorted by name."""
    if data is None:
        from pydoc_data.topics import topics

        return [Document(name, topics[name]) for name in sorted(topics) if topics[name].strip()]
    data = Path(data)
    if data.is_file():
        if data.suffix.lower() not in TEXT_SUFFIXES:
            raise PymlError(
                f"{data}: neither text ({', '.join(TEXT_SUFFIXES)}) nor examples ({', '.join(EXAMPLE_SUFFIXES)})"
            )
        paths = [data]
    elif data.is_dir():
        paths = sorted(p for p in data.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
        if not paths:
            raise PymlError(
                f"{data}: no text files in this folder (looked for {', '.join(TEXT_SUFFIXES)})"
            )
    else:
        raise PymlError(f"{data}: no such file or folder (--data takes a text file or a folder)")
    documents = [
        Document(str(path.relative_to(data) if data.is_dir() else path), _read_text(path))
        for path in paths
    ]
    documents = [document for document in documents if document.text.strip()]
    if not documents:
        raise PymlError(f"{data}: holds no text (every file is empty)")
    return documents


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise PymlError(
            f"{path}: not UTF-8 text (byte {error.start}); convert it or leave it out of --data"
        ) from None
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None


def split_documents(
    documents: list[Document], held_out_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """(train, held-out): a seeded choice of whole documents, at least one on each side, so the
    held-out loss measures text the model never trained on. A corpus of one document is cut at a
    line break instead: its last `held_out_fraction` of text is held out."""
    if not 0.0 < held_out_fraction < 1.0:
        raise PymlError(f"held-out fraction must lie in (0, 1), got {held_out_fraction}")
    if len(documents) == 1:
        return _split_one_document(documents[0], held_out_fraction)
    count = min(len(documents) - 1, max(1, round(held_out_fraction * len(documents))))
    held_out_indices = set(np.random.default_rng(seed).permutation(len(documents))[:count].tolist())
    train = [d for i, d in enumerate(documents) if i not in held_out_indices]
    held_out = [d for i, d in enumerate(documents) if i in held_out_indices]
    return train, held_out


def _split_one_document(document: Document, held_out_fraction: float) -> tuple[list, list]:
    cut = round(len(document.text) * (1.0 - held_out_fraction))
    line_break = document.text.rfind("\n", 0, cut)
    cut = line_break + 1 if line_break > 0 else cut
    head, tail = document.text[:cut], document.text[cut:]
    if not head.strip() or not tail.strip():
        raise PymlError(
            f"{document.name}: too short to split into train and held-out text; give more text"
        )
    return [Document(document.name, head)], [Document(f"{document.name} (tail)", tail)]


def encode_documents(
    documents: list[Document], encode_batch: Callable[[list[str]], list[list[int]]], eos_id: int
) -> np.ndarray:
    """One int64 stream: each document's token ids (as `encode_batch` frames a text: Gemma's
    tokenizer starts each with <bos>) followed by `eos_id`, so the model sees where one document
    ends and the next begins."""
    encoded = encode_batch([document.text for document in documents])
    stream = []
    for ids in encoded:
        stream.extend(ids)
        stream.append(eos_id)
    return np.asarray(stream, dtype=np.int64)


def start_id(encode: Callable[[str, bool], list[int]]) -> int | None:
    """The id a tokenizer puts before every text (Gemma's <bos>; SmolLM2's puts none), given
    `encode(text, add_special_tokens)`."""
    framed, plain = encode("a", True), encode("a", False)
    if len(framed) > len(plain) and framed[1 : 1 + len(plain)] == plain:
        return framed[0]
    return None


def pack(token_ids: np.ndarray, seq_len: int, start: int | None = None) -> np.ndarray:
    """Windows (n, seq_len + 1) of the stream at stride seq_len: row[:-1] are a sequence's inputs,
    row[1:] its next-token targets, and every token is a target exactly once (the tail that
    does not fill a window is dropped).

    With `start` (the id a tokenizer puts before every text), every row begins with it and holds
    seq_len tokens of the stream after it: a model trained that way (Gemma) counts on it at
    position 0. Gemma 3 270M's loss on 128-token windows of the default corpus was 5.30 without
    it and 3.20 with it (its predictions after the first 8 positions: 4.84 and 2.95). A window
    that begins where a document does starts with it twice, once from the document's framing."""
    if seq_len < 1:
        raise PymlError(f"sequence length must be positive, got {seq_len}")
    stream_tokens = seq_len + (start is None)  # the start id stands in for the first input
    count = (len(token_ids) - (start is None)) // seq_len
    if count < 1:
        raise PymlError(
            f"{len(token_ids)} tokens cannot fill one sequence of {seq_len} (+1 target); "
            "use a shorter --seq or more text"
        )
    starts = np.arange(count)[:, None] * seq_len
    windows = token_ids[starts + np.arange(stream_tokens)[None, :]]
    if start is not None:
        windows = np.concatenate([np.full((count, 1), start, token_ids.dtype), windows], axis=1)
    return np.ascontiguousarray(windows)


def next_token_pairs(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), both (n, seq_len), row-aligned with `windows`."""
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def fingerprint(*arrays: np.ndarray) -> str:
    """A hash of the arrays' bytes, kept in checkpoints so a resume on changed data is refused."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class Batches:
    """Endless batches of rows of `arrays` (aligned on their first axis): each epoch visits the
    rows in a fresh permutation drawn from a seeded generator, `batch_size` rows at a time; the
    last rows that cannot fill a batch wait for the next epoch's order.

    The state (epoch, position in the epoch, and the generator's state before it drew this epoch's
    permutation) is plain JSON data; restoring it reproduces every later batch exactly."""

    def __init__(self, arrays: tuple[np.ndarray, ...], batch_size: int, seed: int):
        rows = {len(array) for array in arrays}
        if len(rows) != 1:
            raise PymlError(f"batched arrays must have the same number of rows, got {sorted(rows)}")
        (self.rows,) = rows
        if not 1 <= batch_size <= self.rows:
            raise PymlError(
                f"batch size {batch_size} needs between 1 and {self.rows} examples "
                f"(the training data has {self.rows}); use a smaller --batch or more data"
            )
        self.arrays, self.batch_size = arrays, batch_size
        self.generator = np.random.default_rng(seed)
        self.epoch = 0
        self._start_epoch(self.generator.bit_generator.state)

    def _start_epoch(self, generator_state: dict) -> None:
        self.generator.bit_generator.state = generator_state
        self.epoch_generator_state = generator_state
        self.order = self.generator.permutation(self.rows)
        self.position = 0

    def next_batch(self) -> tuple[np.ndarray, ...]:
        if self.position + self.batch_size > self.rows:
            self.epoch += 1
            self._start_epoch(self.generator.bit_generator.state)
        rows = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return tuple(array[rows] for array in self.arrays)

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "epoch_generator_state": self.epoch_generator_state,
        }

    def load_state(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self._start_epoch(state["epoch_generator_state"])
        self.position = state["position"]
