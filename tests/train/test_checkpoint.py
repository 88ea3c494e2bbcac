"""Checkpoints: weights, optimizer moments, step count and state round-trip exactly; every one is
kept, or with --keep N the N newest and the best, older ones deleted only once a new one is
complete."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.train import checkpoint as checkpoint_module
from pyml.train.checkpoint import (
    checkpoints_to_delete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from tests.support.project_packages import project_package

m = project_package("mlp_digits")


def trained_model(steps=3):
    model = m.Model.initialized(seed=0)
    optimizer = m.AdamW(model)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        m.train_step(model, optimizer, rng.random((8, 64)), rng.integers(0, 10, 8))
    return model, optimizer


def test_round_trip_is_exact(tmp_path):
    model, optimizer = trained_model()
    state = {"step": 3, "data": {"epoch": 1, "position": 8}, "train_losses": [2.5, 2.25, 2.0]}
    path = save_checkpoint(tmp_path, model, optimizer, state)
    assert path == tmp_path / "step_000003" and latest_checkpoint(tmp_path) == path

    restored = m.Model()
    restored_optimizer = m.AdamW(restored)
    loaded = load_checkpoint(path, restored, restored_optimizer)
    assert loaded == {**state, "optimizer_step_count": 3, "parameter_layout": m.Parameters.LAYOUT}
    assert restored_optimizer.step_count == 3
    assert (restored.params.flat == model.params.flat).all()
    for name, moment in optimizer.state().items():
        assert (restored_optimizer.state()[name] == moment).all()


def kept_after(keep, evaluations=(), step=None) -> dict:
    """A checkpoint state of a run with --keep `keep` (None: every checkpoint kept)."""
    return {"step": step, "config": {"keep": keep}, "evaluations": list(evaluations)}


def test_with_keep_1_a_new_checkpoint_replaces_the_old_once_written(tmp_path):
    model, optimizer = trained_model()
    save_checkpoint(tmp_path, model, optimizer, kept_after(1, step=3))
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()  # a save killed half way, by an earlier run that no longer runs
    (tmp_path / f".step_000007.{killed.pid}.tmp").mkdir()
    save_checkpoint(tmp_path, model, optimizer, kept_after(1, step=7))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000007"]
    assert not list(tmp_path.glob(".*.tmp"))
    assert read_state(tmp_path / "step_000007")["step"] == 7


def test_an_unfinished_checkpoint_is_never_the_latest(tmp_path):
    model, optimizer = trained_model()
    save_checkpoint(tmp_path, model, optimizer, {"step": 3})
    (tmp_path / ".step_000009.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    assert latest_checkpoint(tmp_path / "nothing here") is None


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    model, optimizer = trained_model()
    path = save_checkpoint(tmp_path, model, optimizer, {"step": 3})
    llama = project_package("llama_tiny")
    other = llama.Model()
    with pytest.raises(PymlError, match="missing tensor"):
        load_checkpoint(path, other, llama.AdamW(other))


@pytest.mark.parametrize("layout", [None, "fc1_weight(64,128) fc1_bias(128)"])
def test_optimizer_state_of_another_layout_is_refused(tmp_path, layout):
    # flat moments saved under another parameter order (or by a pyml that did not record the
    # order) would be applied to the wrong weights
    model, optimizer = trained_model()
    path = save_checkpoint(tmp_path, model, optimizer, {"step": 3})
    state = read_state(path)
    if layout is None:
        del state["parameter_layout"]
    else:
        state["parameter_layout"] = layout
    (path / "state.json").write_text(json.dumps(state))
    restored = m.Model()
    with pytest.raises(PymlError, match="laid out for other parameters"):
        load_checkpoint(path, restored, m.AdamW(restored))


def test_every_checkpoint_is_kept_by_default(tmp_path):
    model, optimizer = trained_model()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, optimizer, kept_after(None, step=step))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000006"]


def test_keep_2_leaves_the_two_newest_and_the_best(tmp_path):
    model, optimizer = trained_model()
    # the held-out loss is lowest at step 2, then rises: step 2 is the best and stays
    evaluations = [{"step": 0, "loss": 3.0}, {"step": 2, "loss": 1.0}, {"step": 4, "loss": 1.5},
                   {"step": 6, "loss": 2.0}, {"step": 8, "loss": 2.5}]  # fmt: skip
    for step in (2, 4, 6, 8):
        seen = [evaluation for evaluation in evaluations if evaluation["step"] <= step]
        save_checkpoint(tmp_path, model, optimizer, kept_after(2, seen, step))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000006", "step_000008"]

    # falling: the best is the latest, so exactly the two newest stay
    falling = tmp_path / "falling"
    for step in (2, 4, 6):
        seen = [{"step": s, "loss": 10.0 - s} for s in range(0, step + 1, 2)]
        save_checkpoint(falling, model, optimizer, kept_after(2, seen, step))
    assert [p.name for p in list_checkpoints(falling)] == ["step_000004", "step_000006"]


def test_checkpoints_to_delete_never_names_the_latest_or_the_best(tmp_path):
    checkpoints = [tmp_path / f"step_{step:06d}" for step in (1, 2, 3, 4)]
    evaluations = [{"step": 1, "loss": 0.5}, {"step": 3, "loss": 0.7}]
    assert checkpoints_to_delete(checkpoints, None, evaluations) == []
    assert checkpoints_to_delete(checkpoints, 1, evaluations) == checkpoints[1:3]
    assert checkpoints_to_delete(checkpoints, 1, []) == checkpoints[:3]
    assert checkpoints_to_delete(checkpoints, 4, evaluations) == []


def test_a_failed_save_deletes_nothing(tmp_path, monkeypatch):
    model, optimizer = trained_model()
    for step in (2, 4):
        save_checkpoint(tmp_path, model, optimizer, kept_after(1, step=step))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "write_safetensors", full_disk)
    with pytest.raises(PymlError, match="step_000006: cannot write the checkpoint: no space left"):
        save_checkpoint(tmp_path, model, optimizer, kept_after(1, step=6))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004"]
