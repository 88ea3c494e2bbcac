"""The real Gemma 3 270M through the generated package (gen/gemma3_270m, picked by the folder's
spec.toml) against Hugging Face transformers' Gemma3ForCausalLM loading the imported folder:
logits on a fixed prompt, 32 greedy tokens on three prompts (one longer than the 512-token
sliding window, so the window and the sliding layers' ring-buffer cache are exercised), and
`pyml generate` itself. transformers runs once per module and is released before ours loads."""

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydoc_data.topics import topics
from transformers import Gemma3ForCausalLM

from pyml.errors import PymlError
from pyml.generate import decoding as generation

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 32
WINDOW = 512
PROMPTS = {
    "prose": "The capital of France is",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    # CPython's own documentation of class definitions: 681 tokens, past the window
    "long": topics["class"],
}


@pytest.fixture(scope="module")
def tokenizer(gemma3_dir):
    return generation.load_tokenizer(gemma3_dir)


@pytest.fixture(scope="module")
def prompt_ids(gemma3_dir, tokenizer):
    return {name: generation.prompt_ids(gemma3_dir, tokenizer, text, chat=False)
            for name, text in PROMPTS.items()}


@pytest.fixture(scope="module")
def reference(gemma3_dir, prompt_ids):
    """transformers' logits on the prose prompt and greedy tokens on every prompt; the model is
    dropped before ours is loaded, so the two never hold memory at once."""
    model = Gemma3ForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids["prose"]])).logits[0].numpy()
        greedy = {}
        for name, ids in prompt_ids.items():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            greedy[name] = out[0, len(ids):].tolist()
    del model
    gc.collect()
    return logits, greedy


@pytest.fixture(scope="module")
def ours(gemma3_dir, reference):  # after `reference`, which has released transformers' model
    return generation.load_model(gemma3_dir)  # the folder's spec.toml: gen.gemma3_270m


def test_prompts_start_with_bos_and_one_passes_the_window(prompt_ids):
    assert all(ids[0] == 2 for ids in prompt_ids.values())  # <bos>, as transformers' tokenizer
    assert len(prompt_ids["long"]) > WINDOW + 100


@pytest.mark.slow
def test_logits_match_transformers(ours, reference, prompt_ids):
    theirs, _ = reference
    mine = ours.forward(np.array([prompt_ids["prose"]]))[0]
    # float32, 18 layers, other summation orders: measured 3.2e-5 on logits up to 22.4
    assert np.abs(mine - theirs).max() < 2e-4
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(ours, reference, tokenizer, prompt_ids, gemma3_dir, name):
    _, greedy = reference
    result = generation.generate(ours, tokenizer, prompt_ids[name], NEW_TOKENS,
                                 generation.eos_ids(gemma3_dir), out=None)
    assert len(greedy[name]) == NEW_TOKENS  # no end of text: all 32 tokens are compared
    assert result.new_ids == greedy[name]


@pytest.fixture(scope="module")
def fused(gemma3_dir, reference):
    """The default --weights (as-stored): the fused decode step on the GGUF's own blocks."""
    return generation.load_decoder(gemma3_dir)


@pytest.mark.slow
def test_fused_step_greedy_tokens_match_transformers_past_the_window(
    fused, reference, tokenizer, prompt_ids, gemma3_dir
):
    # the shipped Q4_K_M file: all stays quantized (ffn_down Q4_K in some layers, Q6_K in others)
    # but q, k, v, whose v is Q8_0 in some layers beside Q5_0 q and k: float32 rows
    assert fused.formats == {"self_attn_qkv": "F32", "self_attn_o": "Q4_K", "mlp_gate_up": "Q5_0",
                             "mlp_down": "Q4_K/Q6_K", "lm_head": "Q8_0"}
    result = generation.generate(fused, tokenizer, prompt_ids["long"], NEW_TOKENS,
                                 generation.eos_ids(gemma3_dir), out=None)
    assert result.new_ids == reference[1]["long"]


def pyml(*args):
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_cli_imports_the_shipped_model_and_generates_with_its_spec(tmp_path, tokenizer, reference):
    folder = tmp_path / "any-name"  # the shipped model's spec keeps its own name
    imported = pyml("import-gguf", "--shipped", "gemma3-270m", "--out", str(folder))
    assert imported.returncode == 0, imported.stderr
    assert 'name = "gemma3_270m"' in (folder / "spec.toml").read_text()
    result = pyml("generate", "--model", str(folder), "--prompt", PROMPTS["prose"],
                  "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == tokenizer.decode(reference[1]["prose"][:8]).strip()


def folder_copy(gemma3_dir: Path, folder: Path, config: dict | None = None) -> Path:
    """The description files of the imported folder (not its weights), edited."""
    folder.mkdir()
    for name in ("config.json", "spec.toml", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma3_dir / name, folder / name)
    if config is not None:
        edited = json.loads((folder / "config.json").read_text()) | config
        (folder / "config.json").write_text(json.dumps(edited))
    return folder


@pytest.mark.parametrize("field, value, message", [
    ("sliding_window", 1024, "sliding_window is 1024 in config.json but 512 in the spec"),
    ("rope_local_base_freq", 1e6, "rope_local_base_freq is 1000000.0 in config.json but 10000.0"),
    ("layer_types", ["full_attention"] * 18, "layer_types is ['full_attention', "),
    ("query_pre_attn_scalar", 640, "query_pre_attn_scalar is 640 in config.json but 256.0"),
    ("hidden_activation", "gelu", "hidden_activation is 'gelu' in config.json but 'gelu_pytorch_tanh'"),
    ("num_key_value_heads", 4, "num_key_value_heads is 4 in config.json but 1 in the spec"),
    ("model_type", "llama", "model_type is 'llama' in config.json but the spec is 'gemma3_text'"),
])
def test_a_config_that_does_not_describe_the_spec_is_named_by_field(
    gemma3_dir, tmp_path, field, value, message
):
    folder = folder_copy(gemma3_dir, tmp_path / "edited", config={field: value})
    with pytest.raises(PymlError, match=r"does not hold the model of .*spec\.toml: ") as error:
        generation.load_model(folder)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_gemma_folder_refuses_another_spec(gemma3_dir):
    with pytest.raises(PymlError, match="model_type is 'gemma3_text' in config.json but the spec "
                                        "is 'llama'"):
        generation.load_model(gemma3_dir, ROOT / "specs" / "smollm2_135m.toml")


@pytest.mark.parametrize("args, message", [
    (["--chat"], "has no chat template (a base model is prompted with plain text): drop --chat"),
    (["--spec", "specs/mlp_digits.toml"], "specs/mlp_digits.toml: `pyml generate` needs a decoder spec"),
])
def test_cli_refuses_in_one_line(gemma3_dir, args, message):
    result = pyml("generate", "--model", str(gemma3_dir), "--prompt", "hi", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_folder_without_its_spec_asks_for_one(gemma3_dir, tmp_path):
    folder = folder_copy(gemma3_dir, tmp_path / "no-spec")
    (folder / "spec.toml").unlink()
    with pytest.raises(PymlError, match=r"spec.toml: missing .*give the model's spec with --spec"):
        generation.load_model(folder)
