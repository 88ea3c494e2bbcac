"""The real SmolLM2-135M-Instruct through the generated package, for what only SmolLM2 has: its
chat prompt against transformers', the fused step's blocks and logits, int8 activations, and
`pyml generate` itself. Its logits and greedy tokens against transformers, from the float32
model and the fused step, are checked with the other families' in test_shipped_generation.py."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.generate import decoding as generation
from tests.support.shipped import PROMPTS

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "smollm2_135m.toml"
QUESTION = PROMPTS["smollm2"]["chat"].text


@pytest.fixture
def run(shipped):
    return shipped("smollm2")


@pytest.fixture
def model_dir(smollm2_folder):
    # named as `pyml import-gguf` names the shipped model's spec: gen/smollm2_135m runs the folder
    return smollm2_folder


@pytest.fixture
def chat_ids(run):
    return run.prompt_ids(PROMPTS["smollm2"]["chat"])


def test_chat_prompt_ids_match_transformers(chat_ids, smollm2_reference_tokenizer):
    tokenizer = smollm2_reference_tokenizer
    expected = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert chat_ids == list(expected)


def test_config_that_disagrees_with_the_spec_is_named(tmp_path, model_dir):
    import json
    import shutil

    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 12
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PymlError, match="num_hidden_layers is 12 in config.json but 30 in the spec"):
        generation.load_model(tmp_path, SPEC)


def pyml(*args):
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_cli_generate_answers_the_chat_question(model_dir):
    result = pyml("generate", "--model", str(model_dir), "--chat", "--prompt", QUESTION,
                  "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    assert "decode:" in result.stderr and "tokens/s" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "/nonexistent/model: no such folder"),
    (["--temperature", "-1"], "--temperature must be a number >= 0 (0: greedy), not -1.0"),
    (["--weights", "q5_0"], "--weights must be one of as-stored, f32, q8_0, q4_0, q4_1, not 'q5_0'"),
    (["--activations", "int8"], "--activations must be one of f32, q8_0, not 'int8'"),
])
def test_cli_generate_rejects_bad_input_in_one_line(args, message):
    result = pyml("generate", "--prompt", "hi", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_fused_step_keeps_the_gguf_blocks(run):
    from pyml.weight_formats import GGMLType

    kinds = {prefix: set(np.unique(weight[0]).tolist()) for prefix, weight in run.fused.weights.items()
             if prefix != "embed"}
    # the shipped file: Q4_1 projections, the tied head in Q8_0 (the embedding's own type)
    q4_1, q8_0 = GGMLType.Q4_1, GGMLType.Q8_0  # a row's kind is its format's type id
    assert kinds == {"self_attn_qkv": {q4_1}, "self_attn_o": {q4_1},
                     "mlp_gate_up": {q4_1}, "mlp_down": {q4_1}, "lm_head": {q8_0}}


def test_fused_decode_steps_match_the_float32_forward_on_the_same_weights(run, chat_ids):
    """The folder's float32 weights are the GGUF's dequantized: the same function, summed in
    another order (float32 partial sums per 16 lanes against BLAS)."""
    model, fused = run.model, run.fused
    full = model.forward(np.array([chat_ids]))[0]
    cache, _ = fused.start_decoding(np.array([chat_ids[:20]]), len(chat_ids))
    worst = 0.0
    for position in range(20, len(chat_ids)):
        logits = fused.decode(cache, np.array([chat_ids[position]]))
        worst = max(worst, float(np.abs(logits[0] - full[position]).max()))
        assert logits[0].argmax() == full[position].argmax()
    print(f"largest logit difference to the float32 forward: {worst:.2e}")
    assert worst < 1e-3  # logits of magnitude ~20 (5e-5 here on 2026-12-01)


def test_fused_step_at_a_long_context(run):
    """A sequence of 560 positions, past the longest the other tests decode: its last logits
    against the float32 forward on the same ids, and, decoded beside a short sequence in one batch
    (the caches' rows hold each kv head's positions contiguously), the same bits as alone."""
    from pyml.generate.quantized import DecodingBatch

    ids = np.random.default_rng(7).integers(100, 40000, 560).tolist()
    prompt = len(ids) - 4
    full = run.model.forward(np.array([ids]))[0]
    cache, logits = run.fused.start_decoding(np.array([ids[:prompt]]), len(ids))
    alone = [logits[0]] + [run.fused.decode(cache, np.array([token]))[0] for token in ids[prompt:-1]]
    for position, row in zip(range(prompt - 1, len(ids)), alone):
        assert np.abs(row - full[position]).max() < 1e-3, position
    batch = DecodingBatch(run.fused, 2, len(ids), chunk=256)
    long_row, short_row = batch.add(ids[:prompt]), batch.add(ids[:5])
    together = {}
    while long_row not in together:
        together.update(batch.step({short_row: 7} if short_row in together else {}))
    together = [together[long_row]]
    for token in ids[prompt:-1]:
        together.append(batch.step({long_row: token, short_row: 7})[long_row])
    for mine, theirs in zip(together, alone):
        np.testing.assert_array_equal(mine, theirs)


def test_int8_activations_decode_near_the_float32_forward(run, chat_ids, model_dir):
    """--activations q8_0 rounds every product's input to int8 (as llama.cpp does), the prompt's
    too: the logits move (by up to 1.1 here on 2026-12-04, of magnitude ~20: the error of each
    product, 5e-3 of it, grows over 30 layers), and each position's greedy token is one the
    float32 forward ranks in its top 3. (The answer's first token is a near tie in float32, "The"
    25.33 against "L" 25.24, which the rounding turns: the greedy answer is not Paris.)"""
    int8 = generation.load_decoder(model_dir, SPEC, activations="q8_0")
    # the embedding reads its rows as stored (one per token): it has no products to round
    assert int8.formats == {"self_attn_qkv": "Q4_1 x Q8_0 activations", "self_attn_o": "Q4_1 x Q8_0 activations",
                            "mlp_gate_up": "Q4_1 x Q8_0 activations", "mlp_down": "Q4_1 x Q8_0 activations",
                            "lm_head": "Q8_0 x Q8_0 activations", "embed": "Q8_0"}
    full = run.model.forward(np.array([chat_ids]))[0]
    cache, logits = int8.start_decoding(np.array([chat_ids[:20]]), len(chat_ids))
    differences = []
    for position in range(20, len(chat_ids)):
        assert logits[0].argmax() in np.argsort(-full[position - 1])[:3]
        logits = int8.decode(cache, np.array([chat_ids[position]]))
        differences.append(float(np.abs(logits[0] - full[position]).max()))
    print(f"largest logit difference to the float32 forward: {max(differences):.2e}")
    assert 1e-3 < max(differences) < 3.0


def test_int8_activations_on_the_gpu_are_refused_in_one_line(model_dir):
    with pytest.raises(PymlError, match="--activations q8_0 runs on the CPU only: leave it out to "
                                        "decode on the GPU"):
        generation.load_decoder(model_dir, SPEC, device="cuda", activations="q8_0")
