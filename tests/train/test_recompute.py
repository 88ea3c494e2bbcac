"""Gradient checkpointing (`DecoderModel.recompute`, `pyml train --recompute`): the backward runs
each block's forward again from its input in the residual stream instead of keeping what its
adjoints read for every layer. The same kernels on the same inputs, so the loss and every gradient
are bit-identical to the run that keeps them (float64 and float32; a full model and a LoRA one;
rows of one sequence and rows packing several; a Gemma-shaped spec with sliding windows), in a
fraction of the activation memory, which `pyml train` states and `pyml gen` shows."""

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from pyml.codegen.emit import describe_size
from pyml.codegen.lower import lower
from pyml.codegen.schedule import plan_layout, training_memory
from pyml.errors import PymlError
from pyml.spec import load_spec
from pyml.train.checkpoint import read_state
from pyml.train.lora import lora_settings, lora_spec
from pyml.train.run import train
from tests.support.generator_fuzz import CORPUS, generated_package, packed_positions
from tests.support.model_folders import tiny_text, tiny_training
from tests.support.project_packages import project_package

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
B, T = 2, 8  # the Gemma-shaped spec's max_seq_len: its sliding windows (3) are shorter


def packages():
    """(name, package) of llama_tiny as shipped, with LoRA adapters on every projection, and of
    the Gemma-shaped corpus spec (sliding windows between global layers, 3 blocks)."""
    gemma = tomllib.loads((CORPUS / "gemma_shaped.toml").read_text())
    lora = lora_settings(4, 8.0, ["q", "k", "v", "o", "gate", "up", "down"])
    return [("llama_tiny", project_package("llama_tiny")),
            ("llama_tiny_lora", lora_spec(SPECS / "llama_tiny.toml", lora)[1]),
            ("gemma_shaped", generated_package(gemma)[1])]


def random_weights(package, seed: int) -> dict[str, np.ndarray]:
    """Every tensor the model loads (a LoRA model's frozen base and its adapters, B included),
    random: matrices N(0, 1/fan_in), vectors near 1."""
    rng = np.random.default_rng(seed)
    tensors = package.Model.tensors(package.Model.host_parameters())
    return {name: rng.normal(0.0, 1.0 / np.sqrt(view.shape[-1]), view.shape) if view.ndim == 2
            else 1.0 + rng.normal(0.0, 0.1, view.shape) for name, view in tensors.items()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name, package", packages(), ids=lambda value: value if isinstance(value, str) else "")
def test_recomputed_loss_and_gradients_are_bit_identical(name, package, dtype):
    model = package.Model(dtype=dtype)
    model.load_tensors(random_weights(package, seed=3), "random")
    rng = np.random.default_rng(4)
    vocab = package.Model.VOCAB
    inputs, targets = rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))
    for positions in (None, packed_positions(rng, B, T)):
        kept = {}
        for recompute in (False, True):
            model.recompute = recompute
            loss = model.loss_and_grads(inputs, targets, positions=positions)
            kept[recompute] = loss, model.device.to_host(model.grads.flat).copy()
        assert np.isfinite(kept[False][0]) and kept[True][0] == kept[False][0]
        assert np.array_equal(kept[True][1], kept[False][1])
    # the two modes' buffers are kept apart: one slot of saved activations, or one per layer
    assert sorted(key[2] for key in model.buffers) == [1, package.Model.N_LAYERS]


def test_decoding_after_recomputed_training_keeps_every_layers_keys():
    """A prompt's forward fills the cache from every layer's keys and values, so it asks for the
    buffers that keep them whatever `recompute` says."""
    package = project_package("llama_tiny")
    model = package.Model(dtype=np.float64)
    model.load_tensors(random_weights(package, seed=5), "random")
    ids = np.random.default_rng(6).integers(0, package.Model.VOCAB, (2, 9))
    expected = model.forward(ids)[:, -1]
    model.recompute = True
    model.loss_and_grads(ids, ids)
    cache, _ = model.start_decoding(ids[:, :4], 9)
    for position in range(4, 9):
        last = model.decode(cache, ids[:, position])
    assert np.allclose(last, expected, rtol=1e-12, atol=1e-12)


def test_training_memory_keeps_one_block_of_saved_activations():
    graph = lower(load_spec(SPECS / "smollm2_135m.toml"))
    layout = plan_layout(graph)
    kept, recomputed = (training_memory(graph, layout, 2, 512, 4, recompute)
                        for recompute in (False, True))
    saved = sum(np.prod([{"B": 2, "T": 512, "N": 1024}.get(d, d) for d in storage.shape]) * 4
                for storage in graph.storages.values() if storage.name in layout.saved
                and storage.scope == "block")
    assert kept["activations"] - recomputed["activations"] == (graph.n_layers - 1) * saved
    assert recomputed["activations"] < kept["activations"] / 4  # 368 MiB against 1.7 GiB
    assert {name: size for name, size in kept.items() if name != "activations"} == {
        name: size for name, size in recomputed.items() if name != "activations"}


def stated_memory(output: str) -> tuple[float, float]:
    """(the activations the run holds, those of the other mode) from its `memory:` line."""
    line = next(line for line in output.splitlines() if line.startswith("memory: "))
    assert line.startswith("memory: the activations of a training step at batch 2x16 hold ")
    held, other = line.split(" hold ")[1].split(" (")
    return size_bytes(held), size_bytes(other)


def size_bytes(text: str) -> float:
    size, unit = text.split()[:2]
    return float(size) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit.rstrip(",)")]


def test_train_recompute_runs_states_its_memory_and_resumes_either_way(tiny_folders, tmp_path, capsys):
    """`pyml train --recompute` trains a step and states the smaller activations; a resume may
    turn it off (or on) and continues bit-identically: it changes where activations are, not
    results."""
    text = tiny_text(tmp_path / "text.txt")
    run = subprocess.run(
        [sys.executable, "-m", "pyml.cli", "train", "--spec", "specs/llama_tiny.toml", "--init",
         str(tiny_folders["llama"]), "--data", str(text), "--out", str(tmp_path / "cli"),
         "--steps", "1", "--batch", "2", "--seq", "16", "--dtype", "float64", "--eval-batches", "1",
         "--recompute"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "trained to step 1" in run.stdout
    recomputed, without = stated_memory(run.stdout)
    assert " with --recompute (" in run.stdout and recomputed < without
    assert json.loads((tmp_path / "cli" / "step_000001" / "state.json").read_text())["config"]["recompute"]

    straight = tiny_training(tiny_folders["llama"], tmp_path / "straight")
    assert stated_memory(capsys.readouterr().out) == (without, recomputed)
    recomputed_run = tiny_training(tiny_folders["llama"], tmp_path / "resumed", recompute=True)
    assert recomputed_run.train_losses == straight.train_losses
    assert read_state(recomputed_run.checkpoint)["config"]["recompute"] is True
    shutil.rmtree(recomputed_run.checkpoint)  # stopped after step 2, then resumed without it
    resumed = train(None, out=tmp_path / "resumed", resume=True, recompute=False, progress=False)
    assert resumed.train_losses == straight.train_losses  # exact equality
    assert read_state(resumed.checkpoint)["config"]["recompute"] is False
    assert ((resumed.checkpoint / "model.safetensors").read_bytes()
            == (straight.checkpoint / "model.safetensors").read_bytes())


def test_sequential_models_refuse_recompute(tmp_path):
    with pytest.raises(PymlError, match=r"^--recompute runs a decoder's blocks again in the "
                                        r"backward; a sequential model has none: leave it out$"):
        train(SPECS / "mlp_digits.toml", out=tmp_path / "run", recompute=True, progress=False)
    assert not (tmp_path / "run").exists()


def test_gen_shows_the_recomputed_activations():
    summary = describe_size(load_spec(SPECS / "smollm2_135m.toml"))
    assert summary.endswith(", activations 340.9 MiB, 85.3 MiB with --recompute)")
