"""The generator's fuzzing, on device="cuda" under Numba's CUDA simulator or on a GPU (the switch of
tests/support/cuda_target.py): random specs and the regression corpus, each generated package
against the torch reference (loss, logits, every gradient and cached decoding, float64; the corpus
also through the CUDA decode step, decode_cuda.py). Run by tests/cuda/test_cuda_sim.py in a process
of its own; kept small, since the simulator runs each CUDA thread in Python."""

# isort: off
from tests.support.cuda_target import check_target  # first: sets the target
# isort: on

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

FUZZ = settings(max_examples=2, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_the_target_asked_for_runs():
    check_target()


@FUZZ
@given(decoder_specs(max_len=4), st.integers(1, 4), st.integers(0, 2**16))
def test_random_decoders_on_cuda_match_torch(spec, T, seed):
    note(f"spec:\n{to_toml(spec)}\nbatch 1x{T}, seed {seed}")
    check_against_torch(spec, (1, T), seed, device="cuda")


@FUZZ
@given(sequential_specs(), st.integers(1, 3), st.integers(0, 2**16))
def test_random_sequential_models_on_cuda_match_torch(spec, B, seed):
    note(f"spec:\n{to_toml(spec)}\nbatch {B}, seed {seed}")
    check_against_torch(spec, (B, 1), seed, device="cuda")


# Corpus specs whose difference from the rest is not in device code: Llama 3's scaled frequencies
# fill the same RoPE tables the CUDA kernels read (rope_tables, pyml/package/cpu/rope.py), and
# sliding_every_layer's ring of keys is the CPU step's batch (pyml.generate.quantized.DecodingBatch).
# The CPU run of the corpus checks them; the simulator's minutes go to device code.
HOST_ONLY = {"llama3_scaled_rope", "sliding_every_layer"}


@pytest.mark.parametrize("path", [path for path in corpus_specs() if path.stem not in HOST_ONLY],
                         ids=lambda p: p.stem)
def test_regression_corpus_on_cuda_matches_torch(path):
    data = tomllib.loads(path.read_text())
    check_against_torch(data, (1, min(data.get("max_seq_len", 4), 5)), seed=0, device="cuda", fused=True)
