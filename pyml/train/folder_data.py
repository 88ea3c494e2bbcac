"""A decoder's data as its model folder tokenises it: text documents packed into windows
(`pyml.train.data`), or JSONL examples, packed or one per row, with the loss on the answers
(`pyml.train.examples`). `pyml train` splits them into training and held-out rows; `pyml eval`
takes every row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.train import examples
from pyml.train.data import Document, encode_documents, next_token_pairs, pack, start_id

Pairs = tuple[np.ndarray, np.ndarray]  # (inputs, targets), row-aligned


class FolderTokens:
    """A model folder's tokenizer, chat template and special ids, checked against the vocabulary
    of the spec that will run on them."""

    def __init__(self, folder: Path, vocab: int, spec_name: str):
        from tokenizers import Tokenizer

        folder = Path(folder)
        tokenizer_path, config_path = folder / "tokenizer.json", folder / "config.json"
        for path in (tokenizer_path, config_path):
            if not path.is_file():
                raise PymlError(f"{path}: missing; the model must be a model folder (`pyml import-gguf` "
                                "writes one, and every checkpoint is one)")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        if self.tokenizer.get_vocab_size() > vocab:
            raise PymlError(f"{tokenizer_path} has {self.tokenizer.get_vocab_size()} tokens, more than "
                            f"spec '{spec_name}''s vocabulary of {vocab}")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        self.eos_id = config.get("eos_token_id")
        if not isinstance(self.eos_id, int):
            raise PymlError(f"{config_path}: no integer eos_token_id to end each document with")
        pad_id = config.get("pad_token_id")
        self.pad_id = pad_id if isinstance(pad_id, int) else self.eos_id
        self.template = ChatTemplate.of_folder(folder)

    def text_pairs(self, documents: list[Document], seq: int) -> Pairs:
        """The documents as one stream, each framed as the tokenizer frames any text (Gemma's
        <bos>) and ended by the end-of-text id, cut into windows of `seq` tokens."""
        tokenizer = self.tokenizer
        stream = encode_documents(documents, lambda texts: [e.ids for e in tokenizer.encode_batch(texts)],
                                  self.eos_id)
        start = start_id(lambda text, special: tokenizer.encode(text, add_special_tokens=special).ids)
        return next_token_pairs(pack(stream, seq, start))

    def examples(self, data: Path, train_on: str | None) -> list[examples.Example]:
        tokenization = examples.Tokenization(self.tokenizer, self.template, self.eos_id, train_on or "assistant")
        return examples.load_examples(Path(data), tokenization)

    def example_rows(self, chosen: list[examples.Example], seq: int, long_examples: str | None,
                     packing: bool) -> examples.Rows:
        return examples.rows(chosen, seq, self.pad_id, long_examples or "truncate", packing)
