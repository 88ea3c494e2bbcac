"""Sampling in `pyml generate` against the exact distribution it claims to draw from.

The reference is transformers' own TemperatureLogitsWarper and TopPLogitsWarper followed by a
softmax, in float64. The draws are checked by their frequencies with a stated bound, and the seed
by comparing runs from separate generators.
"""

import numpy as np
import pytest
import torch
from scipy.stats import binom
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from pyml.generate import decoding as generation
from tests.support.project_packages import project_package

tiny = project_package("llama_tiny")

VOCAB = 50
TEMPERATURES = [0.3, 0.7, 1.0, 1.8]
TOP_PS = [0.2, 0.5, 0.9, 1.0]


def logits(seed=0):
    return np.random.default_rng(seed).standard_normal(VOCAB) * 3.0


def reference_probabilities(values, temperature, top_p):
    scores = torch.tensor(values, dtype=torch.float64)[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


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
    ours = generation.sampling_probabilities(values, temperature, top_p)
    np.testing.assert_allclose(ours, reference_probabilities(values, temperature, top_p),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 1.0), (1.8, 0.5), (0.3, 1.0)])
def test_draws_follow_the_distribution(temperature, top_p):
    """20000 seeded draws. Each token's count must not lie in either binomial tail of probability
    below 1e-7 (exact tails, so rare tokens are judged right too): a correct sampler fails this
    with probability below 2e-7 per token, 1e-5 for the 50. No token outside the nucleus is drawn."""
    values, draws = logits(), 20000
    rng = np.random.default_rng(1234)
    counts = np.bincount([generation.next_token(values, temperature, top_p, rng)
                          for _ in range(draws)], minlength=VOCAB)
    expected = reference_probabilities(values, temperature, top_p)
    assert (counts[expected == 0] == 0).all()
    kept = expected > 0
    low_tail = binom.cdf(counts[kept], draws, expected[kept])
    high_tail = binom.sf(counts[kept] - 1, draws, expected[kept])
    assert min(low_tail.min(), high_tail.min()) > 1e-7, (counts / draws, expected)


def test_temperature_zero_and_a_small_top_p_are_greedy():
    values = logits()
    rng = np.random.default_rng(0)
    assert generation.next_token(values, 0.0, 1.0, rng) == values.argmax()
    # the most probable token alone holds more than 1% of the mass at any temperature
    assert {generation.next_token(values, 1.0, 0.01, rng) for _ in range(50)} == {values.argmax()}


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others():
    """Separate generators, so a sampler that ignored its generator (or re-seeded a fixed one)
    would fail: 40 draws near the uniform distribution agree by chance with probability 50**-40."""
    flat = logits() / 100.0

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [generation.next_token(flat, 1.0, 1.0, rng) for _ in range(40)]

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
                                   temperature=0.8, top_p=0.95, seed=seed, out=None).new_ids

    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)
