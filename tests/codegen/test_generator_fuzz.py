"""Differential fuzzing of the generator: random valid specs of both forms, generated, imported
and compared in float64 with an independent torch model of the same spec (loss, logits, every
parameter gradient to rtol 1e-9, and decoding with the cache against the full forward pass; the
corpus' specs also through the fused decode step, decode_cpu.py).

Bounded by example count and deadline. A failing draw shrinks (hypothesis) to a minimal spec,
printed as TOML: add it to tests/fuzz_corpus/, where every spec runs on every test run.
"""

import tomllib

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from tests.support.generator_fuzz import (
    check_against_torch,
    corpus_specs,
    decoder_specs,
    sequential_specs,
    to_toml,
)

FUZZ = settings(max_examples=5, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(decoder_specs(), st.integers(1, 2), st.integers(1, 8), st.integers(0, 2**16))
def test_random_decoders_match_torch(spec, B, T, seed):
    note(f"spec:\n{to_toml(spec)}\nbatch {B}x{T}, seed {seed}")
    check_against_torch(spec, (B, T), seed)


@FUZZ
@given(sequential_specs(), st.integers(1, 5), st.integers(0, 2**16))
def test_random_sequential_models_match_torch(spec, B, seed):
    note(f"spec:\n{to_toml(spec)}\nbatch {B}, seed {seed}")
    check_against_torch(spec, (B, 1), seed)


@pytest.mark.parametrize("path", corpus_specs(), ids=lambda p: p.stem)
def test_regression_corpus_matches_torch(path):
    data = tomllib.loads(path.read_text())
    check_against_torch(data, (2, data.get("max_seq_len", 8)), seed=0, fused=True)
