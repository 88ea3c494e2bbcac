"""Each family's real model through its generated package (picked by the imported folder's
spec.toml) against transformers loading the same GGUF: the logits of the first prompt, and 32
greedy tokens on every prompt, from the float32 model and from the fused decode step on the GGUF's
own blocks (`--weights as-stored`, the default). Gemma's long prompt passes its 512-token sliding
window, so the window and the sliding layers' ring-buffer cache are exercised.
What only one family has (SmolLM2's chat template and int8 activations, Gemma's per-field config
checks) is in test_smollm2_generate.py and test_gemma3_generate.py."""

import numpy as np
import pytest
import torch

from pyml.generate import decoding as generation
from tests.support.families import FAMILIES
from tests.support.shipped import NEW_TOKENS, PROMPTS

# float32, other summation orders: largest logit difference to transformers on the first prompt
# (measured: SmolLM2 a few 1e-4 over 30 layers, Gemma 3 3.2e-5 over 18, on logits of magnitude ~20)
LOGIT_TOLERANCE = {"smollm2": 2e-3, "gemma3": 2e-4}
# the formats of the shipped files' linear maps and embedding, read where the GGUF stores them:
# SmolLM2's Q4_1 projections and Q8_0 tied head; Gemma's Q4_K_M, its q, k and v Q5_0 but v Q8_0
# in some layers, ffn_down Q4_K in some layers and Q6_K in others
FORMATS = {
    "smollm2": {"self_attn_qkv": "Q4_1", "self_attn_o": "Q4_1", "mlp_gate_up": "Q4_1", "mlp_down": "Q4_1",
                "lm_head": "Q8_0", "embed": "Q8_0"},
    "gemma3": {"self_attn_qkv": "Q5_0/Q8_0", "self_attn_o": "Q4_K", "mlp_gate_up": "Q5_0",
               "mlp_down": "Q4_K/Q6_K", "lm_head": "Q8_0", "embed": "Q8_0"},
}
CASES = [(family, prompt) for family, prompts in PROMPTS.items() for prompt in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(shipped, family):
    run = shipped(family)
    ids = run.prompt_ids(next(iter(PROMPTS[family].values())))
    with torch.no_grad():
        theirs = run.reference_model(torch.tensor([ids])).logits[0].numpy()
    mine = run.model.forward(np.array([ids]))[0]
    assert np.abs(mine - theirs).max() < LOGIT_TOLERANCE[family]
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("family, prompt", CASES)
def test_greedy_tokens_match_transformers(shipped, family, prompt):
    run = shipped(family)
    expected = run.reference_greedy[prompt]
    # all 32 tokens, or up to the end of text
    assert len(expected) == NEW_TOKENS or expected[-1] in generation.eos_ids(run.folder)
    assert run.greedy(run.model, PROMPTS[family][prompt]) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family, prompt", CASES)
def test_the_fused_step_on_the_gguf_blocks_gives_transformers_greedy_tokens(shipped, family, prompt):
    run = shipped(family)
    assert run.fused.formats == FORMATS[family]
    assert run.greedy(run.fused, PROMPTS[family][prompt]) == run.reference_greedy[prompt]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_equal_a_full_forward(shipped, family):
    """The KV cache path gives the logits the full forward pass gives, position by position."""
    run = shipped(family)
    ids = run.prompt_ids(next(iter(PROMPTS[family].values())))
    full = run.model.forward(np.array([ids]))[0]
    cache, logits = run.model.start_decoding(np.array([ids[:3]]), len(ids))
    assert np.abs(logits[0] - full[2]).max() < 1e-3
    for position in range(3, len(ids)):
        logits = run.model.decode(cache, np.array([ids[position]]))
        assert np.abs(logits[0] - full[position]).max() < 1e-3
