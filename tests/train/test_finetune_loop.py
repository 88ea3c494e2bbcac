"""The loop people run: import a GGUF, fine-tune it, chat with the checkpoint, load it in
transformers, export it to GGUF and run that where they run models.

A checkpoint is a model folder: transformers' `from_pretrained` loads it and computes our logits;
`pyml generate` runs it; `pyml export-gguf` writes it as a GGUF that transformers (`gguf_file=`)
and llama.cpp load, with the greedy tokens of `pyml generate` on the checkpoint. The tiny llama
(gen/llama_tiny, float64) checks it exactly; the real SmolLM2-135M and Gemma 3 270M (slow)
check it in float32. Also: resume stays bit-identical, the digits MLP's checkpoint, the held-out
baseline at step 0 and the loss curve.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.model_folder import DESCRIPTION_FILES
from pyml.formats.safetensors_io import read_safetensors
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate import decoding as generation
from pyml.train.checkpoint import read_state
from pyml.train.config import TrainingConfig
from pyml.train.loss_curve import loss_curve_figure
from pyml.train.run import text_pairs, train
from tests.support.hf_reference import llama_in_float64
from tests.support.model_folders import tiny_training
from tests.support.llama_cpp_reference import llama_cpp_module
from tests.support.project_packages import project_package

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"

llama = project_package("llama_tiny")


def pyml(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tiny_folders, tmp_path_factory):
    return tiny_training(tiny_folders["llama"], tmp_path_factory.mktemp("tiny_run") / "run")


def test_a_checkpoint_is_a_model_folder(tiny_folders, tiny_run):
    checkpoint, init = tiny_run.checkpoint, tiny_folders["llama"]
    assert sorted(path.name for path in checkpoint.iterdir()) == sorted(
        [*DESCRIPTION_FILES, "model.safetensors", "spec.toml", "optimizer.safetensors", "state.json"]
    )
    assert (checkpoint / "spec.toml").read_bytes() == (SPECS / "llama_tiny.toml").read_bytes()
    for name in DESCRIPTION_FILES:
        assert (checkpoint / name).read_bytes() == (init / name).read_bytes(), name
    trained = read_safetensors(checkpoint / "model.safetensors")
    initial = StoredFolder(init).dense_tensors()
    assert set(trained) == set(initial)
    assert not np.array_equal(trained["model.norm.weight"], initial["model.norm.weight"])


def test_transformers_loads_the_checkpoint_with_our_logits(tiny_run, monkeypatch):
    checkpoint = tiny_run.checkpoint
    theirs = llama_in_float64(checkpoint, monkeypatch)
    ours = llama.Model.from_safetensors(checkpoint, dtype=np.float64)
    ids = np.random.default_rng(0).integers(0, llama.model.VOCAB, (2, 16))
    with torch.no_grad():
        expected = theirs(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours.forward(ids), expected, rtol=1e-9, atol=1e-12)


def test_greedy_tokens_of_the_checkpoint_equal_transformers(tiny_run, monkeypatch):
    checkpoint = tiny_run.checkpoint
    tokenizer = generation.load_tokenizer(checkpoint)
    ids = generation.prompt_ids(checkpoint, tokenizer, QUESTION, chat=True)
    model = llama.Model.from_safetensors(checkpoint, dtype=np.float64)
    ours = generation.generate(model, tokenizer, ids, 12, set(), out=None).new_ids
    theirs = llama_in_float64(checkpoint, monkeypatch)
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == expected[0, len(ids):].tolist()


def test_pyml_generate_chats_with_the_checkpoint(tiny_run):
    run = pyml("generate", "--model", str(tiny_run.checkpoint), "--spec", "specs/llama_tiny.toml",
               "--chat", "--prompt", QUESTION, "--max-new-tokens", "8")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "decode:" in run.stderr


def test_resuming_from_a_checkpoint_folder_is_bit_identical(tiny_folders, tiny_run, tmp_path):
    out = tmp_path / "halves"
    tiny_training(tiny_folders["llama"], out, steps=2)
    resumed = train(SPECS / "llama_tiny.toml", steps=4, out=out, resume=True, progress=False)
    assert resumed.train_losses == tiny_run.train_losses  # exact float equality
    assert resumed.evaluations == tiny_run.evaluations
    for name in ("model.safetensors", "optimizer.safetensors", *DESCRIPTION_FILES, "spec.toml"):
        assert (resumed.checkpoint / name).read_bytes() == (tiny_run.checkpoint / name).read_bytes()


def test_an_exported_checkpoint_imports_as_the_checkpoint(tiny_run, tmp_path):
    exported = export_gguf(tiny_run.checkpoint, tmp_path / "tiny.gguf", progress=False)
    back = StoredFolder(import_gguf(exported, tmp_path / "back", progress=False)).dense_tensors()
    trained = read_safetensors(tiny_run.checkpoint / "model.safetensors")  # float64: run in float64
    assert set(back) == set(trained)
    for name, weight in trained.items():
        assert np.array_equal(back[name], weight.astype(np.float32)), name


def test_the_held_out_baseline_is_the_loss_before_the_first_step(tiny_folders, tiny_run, monkeypatch):
    """Step 0's held-out loss is transformers' cross-entropy of the --init model on the held-out
    batches (the first eval_batches of batch rows)."""
    state = read_state(tiny_run.checkpoint)
    config = TrainingConfig(**state["config"])
    baseline = tiny_run.evaluations[0]
    assert baseline["step"] == 0 and [e["step"] for e in tiny_run.evaluations] == [0, 2, 4]
    _, (inputs, targets) = text_pairs(config, llama)
    rows = slice(0, config.batch * config.eval_batches)
    init = llama_in_float64(tiny_folders["llama"], monkeypatch)
    with torch.no_grad():
        logits = init(torch.tensor(inputs[rows])).logits
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(targets[rows]).reshape(-1)
    )
    assert baseline["loss"] == pytest.approx(float(expected), rel=1e-9)
    assert tiny_run.evaluations[-1]["loss"] < baseline["loss"]


def test_the_loss_curve_shows_what_people_expect(tiny_run):
    config = TrainingConfig(**read_state(tiny_run.checkpoint)["config"])
    losses = [2.0, 1.0, 3.0, 0.5, 1.5, 1.0, 0.0, 2.0] * 5  # a 40-step run
    evaluations = [{"step": 0, "loss": 2.5}, {"step": 20, "loss": 1.5}, {"step": 40, "loss": 1.2}]
    figure = loss_curve_figure(losses, evaluations, dataclasses.replace(config, steps=40))
    axes = figure.axes[0]
    raw, smooth, held_out = axes.lines
    assert list(raw.get_xdata()) == list(range(1, 41)) and list(raw.get_ydata()) == losses
    # the mean of each step and its neighbours (a window of 3 for 40 steps), cut at both ends
    padded = np.convolve(losses, np.ones(3), "same") / np.convolve(np.ones(40), np.ones(3), "same")
    np.testing.assert_allclose(smooth.get_ydata(), padded, rtol=1e-12)
    assert list(held_out.get_xdata()) == [0, 20, 40]
    figure.canvas.draw()  # lay the ticks out
    ticks = [tick for tick in axes.get_xticks() if 0 <= tick <= 40]
    assert ticks and all(float(tick).is_integer() for tick in ticks)
    (top,) = axes.child_axes  # the second axis: tokens seen, 2 x 16 of them a step
    assert top.get_xlabel() == "tokens seen"
    assert axes.get_xlim()[0] == 0
    title = axes.get_title()
    assert "llama_tiny" in title and "batch 2 x 16 tokens" in title and "lr 0.003" in title
    assert "float64" in title and str(config.init) in title
    assert (tiny_run.checkpoint.parent / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_digits_mlp_checkpoint_holds_its_weights_and_spec(tmp_path):
    mlp = project_package("mlp_digits")
    result = train(SPECS / "mlp_digits.toml", steps=1, out=tmp_path, progress=False)
    assert sorted(path.name for path in result.checkpoint.iterdir()) == [
        "model.safetensors", "optimizer.safetensors", "spec.toml", "state.json"
    ]  # fmt: skip
    assert (result.checkpoint / "spec.toml").read_bytes() == (SPECS / "mlp_digits.toml").read_bytes()
    assert set(read_safetensors(result.checkpoint / "model.safetensors")) == set(
        mlp.Model.tensors(mlp.Parameters(np.zeros(mlp.Parameters.SIZE)))
    )


# -- the real models: a step of fine-tuning each, then the whole loop


def transformers_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def greedy(model, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def check_the_loop(checkpoint: Path, exported: Path, spec: str, ids_for) -> None:
    """transformers' from_pretrained(checkpoint) computes our logits; the checkpoint exported to
    GGUF (`exported`, f32) gives transformers our greedy tokens."""
    from transformers import AutoModelForCausalLM

    package = project_package(spec)
    tokenizer = generation.load_tokenizer(checkpoint)
    ids = ids_for(tokenizer)
    ours = package.Model.from_safetensors(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].numpy()
    mine = ours.forward(np.array([ids]))[0]
    assert np.abs(mine - theirs).max() < 2e-3  # float32, other summation orders
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()
    del reference

    stop = generation.eos_ids(checkpoint)
    expected = generation.generate(ours, tokenizer, ids, 16, stop, out=None).new_ids
    del ours
    tokens = greedy(transformers_from_gguf(exported), ids, 16)
    assert tokens[: len(expected)] == expected


@pytest.mark.slow
def test_smollm2_fine_tuned_is_loaded_chatted_with_and_exported(smollm2_checkpoint, smollm2_export):
    def chat_ids(tokenizer):
        return generation.prompt_ids(smollm2_checkpoint, tokenizer, QUESTION, chat=True)

    check_the_loop(smollm2_checkpoint, smollm2_export, "smollm2_135m", chat_ids)
    # the first complaint: `pyml generate --model CHECKPOINT` after `make demo`
    run = pyml("generate", "--model", str(smollm2_checkpoint), "--chat", "--prompt", QUESTION,
               "--max-new-tokens", "16")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout


@pytest.mark.slow
def test_gemma3_fine_tuned_is_loaded_and_exported(gemma3_checkpoint, gemma3_export):
    def prompt_ids(tokenizer):
        return generation.prompt_ids(gemma3_checkpoint, tokenizer, PROMPT, chat=False)

    check_the_loop(gemma3_checkpoint, gemma3_export, "gemma3_270m", prompt_ids)


# Run in a process of its own: the llama-cpp-python wheel on these machines (0.3.36, from
# /opt/wheels) crashes on every quantised GGUF, the shipped Q4_1 included, so f32 it is.
LLAMA_CPP = """
import json, sys, llama_cpp
path, chat, prompt = sys.argv[1], sys.argv[2] == "chat", sys.argv[3]
model = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False)
if chat:
    answer = model.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=16,
                                          temperature=0.0)["choices"][0]["message"]["content"]
else:
    answer = model.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]
print(json.dumps(answer))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_llama_cpp_loads_the_export_and_answers(request, family):
    llama_cpp_module()  # it runs in a subprocess: a missing llama.cpp fails or skips here, saying so
    import json

    exported = request.getfixturevalue(f"{family}_export")
    chat = family == "smollm2"
    run = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(exported), "chat" if chat else "text",
                          QUESTION if chat else PROMPT], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    answer = json.loads(run.stdout)
    assert answer.strip()
    if chat:
        assert "Paris" in answer
