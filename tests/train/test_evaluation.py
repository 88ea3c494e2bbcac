"""`pyml eval` (`pyml.train.evaluation.evaluate_folder`): the mean cross-entropy of a model folder
on text windows or JSONL examples, over the targets that training counts, against transformers'
loss on the same rows (peft's for a LoRA adapter: tests/train/test_lora_cli.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyml.errors import PymlError
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train.data import load_corpus
from pyml.train.evaluation import evaluate_folder
from pyml.train.folder_data import FolderTokens
from tests.support.hf_reference import llama_in_float64
from tests.support.model_folders import tiny_text, tiny_training

ROOT = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "What does len() return?"},
     {"role": "assistant", "content": "The number of items in a container."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Name a mutable sequence."},
     {"role": "assistant", "content": "A list."},
     {"role": "user", "content": "And an immutable one?"},
     {"role": "assistant", "content": "A tuple, or a string."}],
    [{"role": "user", "content": "What is 2 ** 10?"},
     {"role": "assistant", "content": "1024."}],
]


def reference_loss(reference, inputs: np.ndarray, targets: np.ndarray) -> float:
    """torch's mean cross-entropy of transformers' logits over every target it does not ignore."""
    with torch.no_grad():
        logits = reference(torch.tensor(inputs)).logits
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(targets).reshape(-1), ignore_index=IGNORED_TARGET))


def write_chats(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_models(tiny_folders, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama's imported folder, and a checkpoint two AdamW steps on from it."""
    run = tiny_training(tiny_folders["llama"], tmp_path_factory.mktemp("eval_run") / "run", steps=2)
    return {"folder": tiny_folders["llama"], "checkpoint": run.checkpoint}


@pytest.mark.parametrize("kind", ["folder", "checkpoint"])
def test_text_loss_is_transformers_loss_on_every_window(tiny_models, kind, tmp_path, monkeypatch):
    folder = tiny_models[kind]
    text = tiny_text(tmp_path / "text.txt")
    # batch 4 does not divide the 129 windows: the last forward pass is a short one
    result = evaluate_folder(folder, text, seq=16, batch=4, dtype="float64")
    inputs, targets = FolderTokens(folder, 96, "llama_tiny").text_pairs(load_corpus(text), 16)
    assert len(inputs) % 4 != 0 and result["rows"] == len(inputs) and result["tokens"] == targets.size
    expected = reference_loss(llama_in_float64(folder, monkeypatch), inputs, targets)
    assert result["loss"] == pytest.approx(expected, rel=1e-10)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-10)


def test_chat_loss_counts_the_answers_only_as_transformers_does(smollm2_folder, smollm2_reference, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl")
    result = evaluate_folder(smollm2_folder, data, seq=128, batch=2)
    tokens = FolderTokens(smollm2_folder, 49152, "smollm2_135m")
    # pyml eval packs the chats as training does; the reference runs each in a row of its own
    rows = tokens.example_rows(tokens.examples(data, None), 128, None, packing=False)
    assert result["examples"] == len(CHATS) and result["rows"] < len(CHATS)
    assert result["tokens"] == rows.target_count
    # the answers' tokens and one end-of-turn each, nothing of the prompts or the padding
    answers = [message["content"] for chat in CHATS for message in chat if message["role"] == "assistant"]
    assert rows.target_count == sum(len(tokens.tokenizer.encode(answer).ids) + 1 for answer in answers)
    expected = reference_loss(smollm2_reference[0], rows.inputs, rows.targets)
    assert result["loss"] == pytest.approx(expected, rel=2e-5)
    everything = evaluate_folder(smollm2_folder, data, seq=128, batch=2, train_on="all")
    assert everything["tokens"] > result["tokens"] and everything["loss"] != pytest.approx(result["loss"])


@pytest.mark.parametrize("options, message", [
    (dict(seq=0), "--seq and --batch must be at least 1"),
    (dict(seq=65), "--seq 65 exceeds the model's max_seq_len 64"),
    (dict(dtype="float16"), "--dtype must be float32 or float64"),
    (dict(seq=16, long_examples="keep"), "--long-examples must be one of"),
])
def test_bad_options_are_refused(tiny_folders, tmp_path, options, message):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"text": "a cat sat on the mat"}) + "\n", encoding="utf-8")
    with pytest.raises(PymlError, match=message):
        evaluate_folder(tiny_folders["llama"], data, **options)


def pyml(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pyml.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_prints_the_loss_and_refuses_bad_data_in_one_line(tiny_folders, tmp_path):
    folder = tiny_folders["llama"]
    text = tiny_text(tmp_path / "text.txt")
    run = pyml("eval", "--model", folder, "--data", text, "--seq", 16, "--dtype", "float64", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    expected = evaluate_folder(folder, text, seq=16, dtype="float64")
    assert run.stdout.strip() == (
        f"loss {expected['loss']:.4f}, perplexity {expected['perplexity']:.3f} over {expected['tokens']:,} "
        f"target tokens in {expected['rows']:,} rows of {text}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"messages": [\n', encoding="utf-8")
    run = pyml("eval", "--model", folder, "--data", broken, "--seq", 16, cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and f"{broken}:2" in run.stderr
