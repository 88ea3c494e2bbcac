"""`decoding.IncrementalText`, the text `pyml generate` prints and `pyml serve` streams, against
the tokenizer's own decode of every prefix of the ids: byte-level BPE (SmolLM2's), SentencePiece
with byte fallback (Gemma 3's), and the same with the leading space of the text stripped (what
`pyml import-gguf` builds for a Llama 2 or Mistral GGUF, whose text starts with a space: a
decode of the new tokens alone would lose a word's space), on random ids from the whole
vocabulary and on the ids of text whose characters span several tokens.

Where the prefix ends inside a character, the two may differ: Gemma's byte fallback turns a whole
run of byte tokens into U+FFFD when the run does not decode, a complete character before the
incomplete one included, where the incremental text keeps the complete one. What streaming needs,
and what is asserted: each text the streams would show (not ending in U+FFFD) begins with the one
shown before, and equals the whole decode wherever that is complete too."""

import numpy as np
import pytest
from tokenizers import decoders

from pyml.generate.decoding import IncrementalText, load_tokenizer

TEXT = ("Grüße aus Köln! 東京タワーは高い。 Emoji: 🦙🚀👍🏽 — «quotes», naïve café, "
        "  two spaces,\ttab\nnew line, ∑∫√ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.")


@pytest.fixture(params=["smollm2", "gemma3", "gemma3-leading-space-stripped"])
def tokenizer(request):
    folder = request.getfixturevalue("smollm2_folder" if request.param == "smollm2" else "gemma3_dir")
    tokenizer = load_tokenizer(folder)
    if request.param.endswith("stripped"):
        tokenizer.decoder = decoders.Sequence([tokenizer.decoder, decoders.Strip(" ", 1, 0)])
    return tokenizer


def assert_every_prefix_decodes_alike(tokenizer, ids):
    text, shown = IncrementalText(tokenizer), ""
    for count, token in enumerate(ids, 1):
        ours, whole = text.add(int(token)), tokenizer.decode(list(ids[:count]))
        if not whole.endswith("\ufffd"):
            assert ours == whole, (list(ids[:count]), ours, whole)
        if not ours.endswith("\ufffd"):
            assert ours.startswith(shown), (list(ids[:count]), ours, shown)
            shown = ours


def test_text_of_multibyte_characters(tokenizer):
    assert_every_prefix_decodes_alike(tokenizer, tokenizer.encode(TEXT, add_special_tokens=False).ids)


def test_random_ids(tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(30):
        assert_every_prefix_decodes_alike(tokenizer, rng.integers(0, tokenizer.get_vocab_size(), 40))
