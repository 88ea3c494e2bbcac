"""The real Gemma 3 270M through `pyml generate` (gen/gemma3_270m, picked by the folder's
spec.toml), for what only Gemma has: its base-model prompts (a BOS, no chat template), the
config fields that tie a folder to its spec, and the refusals. Its logits and greedy tokens
against transformers are checked with the other families' in test_shipped_generation.py."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyml.errors import PymlError
from pyml.generate import decoding as generation
from tests.support.shipped import PROMPTS

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 512


@pytest.fixture
def run(shipped):
    return shipped("gemma3")


def test_prompts_start_with_bos_and_one_passes_the_window(run):
    prompt_ids = {name: run.prompt_ids(prompt) for name, prompt in PROMPTS["gemma3"].items()}
    assert all(ids[0] == 2 for ids in prompt_ids.values())  # <bos>, as transformers' tokenizer
    assert len(prompt_ids["long"]) > WINDOW + 100


def pyml(*args):
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_cli_imports_the_shipped_model_and_generates_with_its_spec(tmp_path, run):
    folder = tmp_path / "any-name"  # the shipped model's spec keeps its own name
    imported = pyml("import-gguf", "--shipped", "gemma3-270m", "--out", str(folder))
    assert imported.returncode == 0, imported.stderr
    assert 'name = "gemma3_270m"' in (folder / "spec.toml").read_text()
    result = pyml("generate", "--model", str(folder), "--prompt", PROMPTS["gemma3"]["prose"].text,
                  "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == run.tokenizer.decode(run.reference_greedy["prose"][:8]).strip()


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


def test_a_folder_without_its_spec_runs_the_spec_its_config_describes(gemma3_dir, tmp_path):
    """As a Hugging Face folder as downloaded does: the spec made from config.json is the one
    `pyml import-gguf` wrote (the same dims, windows and RoPE tables), so the same package runs."""
    from pyml.formats.hf_import import folder_spec
    from pyml.spec import load_spec

    from pyml.spec import parse_spec

    folder = folder_copy(gemma3_dir, tmp_path / "no-spec")
    (folder / "spec.toml").unlink()
    written = load_spec(gemma3_dir / "spec.toml")
    assert parse_spec(folder_spec(folder, name=written.name), "config.json") == written
