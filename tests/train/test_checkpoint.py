"""Checkpoints: weights, optimizer moments, step count and state round-trip exactly; a new one
replaces the old only once it is complete."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.train.checkpoint import (
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


def test_a_new_checkpoint_replaces_the_old_once_written(tmp_path):
    model, optimizer = trained_model()
    save_checkpoint(tmp_path, model, optimizer, {"step": 3})
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()  # a save killed half way, by an earlier run that no longer runs
    (tmp_path / f".step_000007.{killed.pid}.tmp").mkdir()
    save_checkpoint(tmp_path, model, optimizer, {"step": 7})
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
