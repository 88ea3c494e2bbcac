"""Sampling in `pyml generate` and `pyml serve` (`decoding.Sampler`) against the exact
distribution it claims to draw from.

The reference is transformers' own logits processors in the order its generate() applies them
(RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
MinPLogitsWarper) followed by a softmax, in float64; the frequency and presence penalties, which
transformers lacks, against OpenAI's formula written out in torch. The draws are checked by their
frequencies with a stated bound, and the seed by comparing runs from separate generators.
"""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import binom
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pyml.generate import decoding as generation
from tests.support.project_packages import project_package

tiny = project_package("llama_tiny")

VOCAB = 50
TEMPERATURES = [0.3, 0.7, 1.0, 1.8]
TOP_PS = [0.2, 0.5, 0.9, 1.0]


def logits(seed=0):
    return np.random.default_rng(seed).standard_normal(VOCAB) * 3.0


def reference_scores(values, top_k=0, min_p=0.0, repetition_penalty=1.0, history=(), temperature=1.0,
                     top_p=1.0):
    scores = torch.tensor(values, dtype=torch.float64)[None]
    if repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([list(history)]), scores)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


def reference_probabilities(values, temperature, top_p, **options):
    return torch.softmax(reference_scores(values, temperature=temperature, top_p=top_p, **options),
                         dim=-1)[0].numpy()


def nucleus_boundary_is_clear(values, temperature, top_p):
    """No cumulative probability within 1e-9 of top_p: there the two formulations of the nucleus
    (the smallest set reaching top_p; the largest tail whose mass stays below 1 - top_p) could
    round to different sets, and the comparison would test rounding, not sampling."""
    scaled = values / temperature
    probs = np.exp(scaled - scaled.max())
    cumulative = np.cumsum(np.sort(probs / probs.sum())[::-1])
    return top_p == 1.0 or np.abs(cumulative - top_p).min() > 1e-9


@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_probabilities_equal_transformers_warpers(temperature, top_p):
    values = logits()
    assert nucleus_boundary_is_clear(values, temperature, top_p)
    ours = generation.Sampler(temperature, top_p).probabilities(values)
    np.testing.assert_allclose(ours, reference_probabilities(values, temperature, top_p),
                               rtol=1e-12, atol=1e-15)


HISTORY = (3, 7, 7, 12, 40, 3, 3)  # prompt and answer so far: some tokens more than once


@pytest.mark.parametrize("options", [
    dict(top_k=5), dict(top_k=1), dict(min_p=0.05), dict(min_p=0.15, top_p=0.9),
    dict(top_k=12, min_p=0.02, top_p=0.8), dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, top_k=20), dict(repetition_penalty=1.5, min_p=0.1, temperature=1.6),
])
def test_top_k_min_p_and_the_repetition_penalty_equal_transformers_processors(options):
    values = logits(3)
    # at temperature 3 the most probable token holds 27% of the mass: every filter has a choice
    temperature, top_p = options.pop("temperature", 3.0), options.pop("top_p", 1.0)
    history = HISTORY if "repetition_penalty" in options else ()
    sampler = generation.Sampler(temperature, top_p, **options)
    ours = sampler.probabilities(values, history[:4], history[4:])
    expected = reference_probabilities(values, temperature, top_p, history=history, **options)
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-15)
    kept = int((ours > 0).sum())
    if options.get("top_k", 2) > 1 and "repetition_penalty" not in options:  # a filter chose
        assert 1 < kept < VOCAB, kept


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 1.2), (1.5, -0.5), (-1.0, 2.0)])
def test_frequency_and_presence_penalties_follow_openais_formula(frequency, presence):
    """OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] the count of
    token j in the answer so far (the prompt does not count)."""
    values, prompt, answer = logits(4), [1, 2, 3], [7, 7, 7, 12, 40, 12]
    counts = torch.bincount(torch.tensor(answer), minlength=VOCAB).to(torch.float64)
    scores = torch.tensor(values) - counts * frequency - (counts > 0).to(torch.float64) * presence
    expected = torch.softmax(scores / 0.9, dim=-1).numpy()
    sampler = generation.Sampler(0.9, frequency_penalty=frequency, presence_penalty=presence)
    np.testing.assert_allclose(sampler.probabilities(values, prompt, answer), expected, rtol=1e-12, atol=1e-15)
    greedy = generation.Sampler(0.0, frequency_penalty=frequency, presence_penalty=presence)
    assert greedy.next_token(values, None, prompt, answer) == int(scores.argmax())


def test_greedy_with_a_repetition_penalty_takes_transformers_choice():
    values = logits(5)
    top = int(np.argmax(values))
    history = (top,)  # the penalty must move the choice away from the most probable token
    expected = int(reference_scores(values, repetition_penalty=3.0, history=history).argmax())
    assert expected != top
    assert generation.Sampler(0.0, repetition_penalty=3.0).next_token(values, None, history, []) == expected


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "--temperature must be a number >= 0"),
    ("top_p", 0.0, "--top-p must be a number in (0, 1]"),
    ("top_k", -1, "--top-k must be an integer >= 0"),
    ("min_p", 1.5, "--min-p must be a number in [0, 1]"),
    ("repetition_penalty", 0.0, "--repetition-penalty must be a number > 0"),
    ("frequency_penalty", float("nan"), "--frequency-penalty must be a number in [-2, 2]"),
    ("temperature", float("inf"), "--temperature must be a number >= 0 (0: greedy), not inf"),
    ("repetition_penalty", float("inf"), "--repetition-penalty must be a number > 0 (1: off), not inf"),
])
def test_values_out_of_range_are_refused_in_one_line(field, value, message):
    with pytest.raises(generation.PymlError, match=re.escape(message)):
        generation.Sampler(**{field: value}).check()


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 1.0), (1.8, 0.5), (0.3, 1.0)])
def test_draws_follow_the_distribution(temperature, top_p):
    """20000 seeded draws. Each token's count must not lie in either binomial tail of probability
    below 1e-7 (exact tails, so rare tokens are judged right too): a correct sampler fails this
    with probability below 2e-7 per token, 1e-5 for the 50. No token outside the nucleus is drawn."""
    values, draws = logits(), 20000
    rng = np.random.default_rng(1234)
    sampler = generation.Sampler(temperature, top_p)
    counts = np.bincount([sampler.next_token(values, rng) for _ in range(draws)], minlength=VOCAB)
    expected = reference_probabilities(values, temperature, top_p)
    assert (counts[expected == 0] == 0).all()
    kept = expected > 0
    low_tail = binom.cdf(counts[kept], draws, expected[kept])
    high_tail = binom.sf(counts[kept] - 1, draws, expected[kept])
    assert min(low_tail.min(), high_tail.min()) > 1e-7, (counts / draws, expected)


@pytest.mark.parametrize("shape", ["peaked", "nearly flat", "flat", "half on one token"])
def test_the_nucleus_of_a_large_vocabulary_is_the_whole_sorts(shape):
    """`nucleus` sorts only the most probable tokens: its set must be the one the whole
    vocabulary's stable sort gives, ties included, also where those tokens hold less than top_p
    (half the mass on one token, the rest spread below its thousandth)."""
    rng = np.random.default_rng(11)
    size = 50_000
    values = {"peaked": rng.standard_normal(size) * 3, "nearly flat": rng.standard_normal(size) * 0.01,
              "flat": np.zeros(size), "half on one token": rng.standard_normal(size) * 0.1}[shape]
    if shape == "half on one token":
        values[123] = np.log(np.exp(values).sum() - np.exp(values[123]))
    probs = np.exp(values - values.max())
    probs /= probs.sum()
    for top_p in (0.1, 0.5, 0.9, 0.999, 1 - 1e-12):
        order = np.argsort(-probs, kind="stable")
        whole = np.sort(order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1])
        assert np.array_equal(generation.nucleus(probs, top_p), whole), top_p


def test_temperature_zero_and_a_small_top_p_are_greedy():
    values = logits()
    rng = np.random.default_rng(0)
    assert generation.Sampler(0.0).next_token(values, rng) == values.argmax()
    # the most probable token alone holds more than 1% of the mass at any temperature
    assert {generation.Sampler(1.0, 0.01).next_token(values, rng) for _ in range(50)} == {values.argmax()}


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others():
    """Separate generators, so a sampler that ignored its generator (or re-seeded a fixed one)
    would fail: 40 draws near the uniform distribution agree by chance with probability 50**-40."""
    flat = logits() / 100.0

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [generation.Sampler(1.0).next_token(flat, rng) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 10  # the draws vary within one run too


class CharacterTokenizer:
    """Just what `generate` asks of a tokenizer: ids back to text."""

    def decode(self, ids):
        return "".join(chr(0x41 + i % 26) for i in ids)


def test_generate_with_a_seed_is_reproducible_and_the_seed_matters():
    model = tiny.Model.initialized(seed=0, dtype=np.float64)
    model.params.flat[:] *= 40.0  # away from the near-uniform logits of a fresh initialisation

    def sampled(seed):
        return generation.generate(model, CharacterTokenizer(), [1, 2, 3], 24, stop=set(),
                                   sampler=generation.Sampler(0.8, 0.95), seed=seed, out=None).new_ids

    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)


def test_pyml_generate_passes_every_sampling_option_and_the_seed_as_given(tiny_folders):
    """`pyml generate` with each sampling option set and --seed 0, then --seed 1, on the tiny
    Llama: each prints `decoding.generate`'s answer for that Sampler and seed (so the command
    hands on every option, and seed 0 as a seed), and the two seeds' answers differ."""
    folder, prompt = tiny_folders["llama"], "the cat sat on the"
    options = dict(temperature=1.5, top_p=0.95, top_k=20, min_p=0.02, repetition_penalty=1.2,
                   frequency_penalty=0.4, presence_penalty=0.3)
    arguments = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    decoder, tokenizer = generation.load_decoder(folder), generation.load_tokenizer(folder)

    def expected(seed: int) -> str:
        return generation.generate(decoder, tokenizer, tokenizer.encode(prompt).ids, 16,
                                   generation.eos_ids(folder), generation.Sampler(**options), seed,
                                   out=None).text

    answers = {}
    for seed in (0, 1):
        run = subprocess.run([sys.executable, "-m", "pyml.cli", "generate", "--model", str(folder),
                              "--prompt", prompt, "--max-new-tokens", "16", f"--seed={seed}",
                              *arguments], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        answers[seed] = run.stdout.removesuffix("\n")
        assert answers[seed] == expected(seed)
    assert answers[0] != answers[1]
