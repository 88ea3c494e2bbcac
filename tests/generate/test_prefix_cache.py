"""The decoding batch's prefix cache: a prompt that begins with what a free row last held is
prefilled from there on, and every logit it then gives is the bits of a batch without the cache
(a prefill from position 0), on a model with full attention and on one whose every layer slides
(its caches a ring: a held row lends a prefix only while the positions past it have not
overwritten what the prompt's next tokens read). A scored prompt (echo's log-probabilities) takes
nothing from the cache: each of its positions' logits are computed."""

from __future__ import annotations

import numpy as np
import pytest

from pyml.generate import decoding
from pyml.generate.quantized import DecodingBatch
from tests.support.model_folders import LLAMA, import_gguf, write_gguf

WINDOW = 8
CHUNK = 4


@pytest.fixture(scope="module", params=["full", "sliding"])
def decoder(request, tmp_path_factory):
    """The fused step on a tiny llama (full attention) or phi3 whose every layer has a window of
    WINDOW positions."""
    root = tmp_path_factory.mktemp(f"prefix-{request.param}")
    architecture, dims = ("llama", LLAMA) if request.param == "full" else ("phi3", LLAMA | {"window": WINDOW})
    write_gguf(root / "tiny.gguf", architecture, dims)
    return request.param, decoding.load_decoder(import_gguf(root / "tiny.gguf", root / "tiny", progress=False))


def decode(batch: DecodingBatch, prompt: list[int], following: list[int]) -> tuple[int, int, list[np.ndarray]]:
    """(its row, the prompt positions the cache held, the logits of the prompt's last position and
    of each following token) of `prompt` alone in `batch`; the row is released after."""
    row = batch.add(prompt)
    cached, drawn = int(batch.lengths[row]), {}
    while row not in drawn:
        drawn = batch.step({})
    logits = [drawn[row]]
    for token in following:
        logits.append(batch.step({row: token})[row])
    batch.release(row)
    return row, cached, logits


def test_a_cached_prefix_gives_the_bits_of_a_prefill(decoder):
    kind, decoder = decoder
    rng = np.random.default_rng(3)
    vocab = decoder.model.VOCAB
    first, answer = rng.integers(3, vocab - 4, 20).tolist(), rng.integers(3, vocab - 4, 6).tolist()
    # the next turn: the first prompt, its answer (the last token of which the step never ran), more
    second = first + answer + rng.integers(3, vocab - 4, 5).tolist()
    # a prompt that leaves the first at position 9, and one that is the first prompt again
    parted, again = first[:9] + rng.integers(3, vocab - 4, 7).tolist(), list(first)
    cached = DecodingBatch(decoder, 2, 64, CHUNK)
    plain = DecodingBatch(decoder, 2, 64, CHUNK, prefix_cache=False)
    row, held, _ = decode(cached, first, answer)
    assert held == 0
    for prompt, following, reuse in [
            (second, answer[:3], {"full": 26, "sliding": 26}),  # all that the row held
            # the first prompt, less its last token (whose logits are drawn from); in a ring of
            # WINDOW + CHUNK - 1 slots the 15 positions the row ran past it overwrote what the
            # prompt's next positions read, so nothing is taken
            (again, answer[:2], {"full": 19, "sliding": 0}),
            (parted, answer[:3], {"full": 9, "sliding": 0})]:
        reused_row, held, logits = decode(cached, prompt, following)
        assert held == reuse[kind], prompt
        if held:
            assert reused_row == row  # the row that held the prefix
        _, nothing, expected = decode(plain, prompt, following)
        assert nothing == 0
        for position, (got, want) in enumerate(zip(logits, expected)):
            np.testing.assert_array_equal(got, want, err_msg=f"{kind}, logits {position}")


def test_the_least_recently_freed_row_is_taken_when_none_holds_a_prefix(decoder):
    _, decoder = decoder
    batch = DecodingBatch(decoder, 3, 64, CHUNK)
    rows = [decode(batch, [5 + n, 6, 7], [])[0] for n in range(3)]
    assert rows == [0, 1, 2]
    assert decode(batch, [40, 41], [])[0] == 0  # freed first, and nothing of it matches
    assert decode(batch, [7, 6, 7, 9], [])[:2] == (2, 3)  # row 2 held [7, 6, 7]


def test_a_scored_prompt_is_prefilled_whole_and_gives_every_positions_logits(decoder):
    _, decoder = decoder
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, decoder.model.VOCAB - 4, 14).tolist()
    batch = DecodingBatch(decoder, 2, 64, CHUNK)
    decode(batch, prompt, [])
    expected = DecodingBatch(decoder, 1, 64, CHUNK, prefix_cache=False).score(prompt)
    row = batch.add(prompt, score_prompt=True)
    assert batch.lengths[row] == 0
    scored, drawn = {}, {}
    while row not in drawn:
        drawn = batch.step({}, scored)
    positions, logits = scored[row]
    assert positions == list(range(len(prompt) - 1))
    np.testing.assert_array_equal(np.array(logits), expected[:-1])
    np.testing.assert_array_equal(drawn[row], expected[-1])
