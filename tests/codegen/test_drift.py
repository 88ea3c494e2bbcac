"""`pyml check` passes on a clean tree and catches each of the four drifts, naming the reason."""

import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

import pyml.project
from pyml.codegen import drift, render
from pyml.codegen.emit import write_generated
from pyml.project import LAWS_DIR, init_project
from pyml.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path):
    """A project (`pyml init`) holding one spec and what `pyml gen` makes of it."""
    init_project(tmp_path)
    (tmp_path / "specs" / "my_decoder.toml").unlink()
    shutil.copy(ROOT / "specs" / "mlp_digits.toml", tmp_path / "specs")
    spec_path = tmp_path / "specs" / "mlp_digits.toml"
    write_generated(load_spec(spec_path), spec_path, tmp_path)
    return tmp_path


def test_the_repository_has_no_drift():
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_a_fresh_generation_has_no_drift(project):
    assert drift.find_drift(project) == []


def test_hand_edit_of_a_generated_file_is_caught(project):
    model = project / "gen" / "mlp_digits" / "model.py"
    original = model.read_text()
    edited = original.replace("k.linear_bias_backward(", "k.linear_backward(", 1)
    assert edited != original
    model.write_text(edited)
    drifts = drift.find_drift(project)
    assert drifts == ["gen/mlp_digits/model.py: differs from a fresh generation "
                      "(edited by hand (the inputs are unchanged))"]


def test_changed_spec_not_regenerated_is_caught(project):
    spec = project / "specs" / "mlp_digits.toml"
    spec.write_text(spec.read_text().replace("out_features = 128", "out_features = 96")
                    .replace("in_features = 128", "in_features = 96"))
    drifts = drift.find_drift(project)
    assert drifts and all("the spec changed and was not regenerated" in line for line in drifts)


def test_changed_law_statement_is_caught(project, tmp_path_factory, monkeypatch):
    copy = tmp_path_factory.mktemp("laws")
    shutil.copytree(LAWS_DIR, copy, dirs_exist_ok=True)
    monkeypatch.setattr(pyml.project, "LAWS_DIR", copy)
    laws = copy / "PyML" / "Laws.lean"
    stated = "dot g (matVec W v) = dot (matTVec W g) v :="
    assert stated in laws.read_text()
    # the same law with its sides swapped: true still, but not the statement the code relies on
    laws.write_text(laws.read_text().replace(stated, "dot (matTVec W g) v = dot g (matVec W v) :=", 1))
    drifts = drift.find_drift(project)
    assert drifts and all("Lean law statement(s) changed since generation: linear_input_adjoint"
                          in line for line in drifts)


def test_changed_template_not_regenerated_is_caught(project, tmp_path_factory, monkeypatch):
    templates = tmp_path_factory.mktemp("copy") / "templates"
    shutil.copytree(render.TEMPLATES, templates)
    model = templates / "model.py.j2"
    model.write_text(model.read_text() + "\n# a new comment\n")
    monkeypatch.setattr(render, "TEMPLATES", templates)
    monkeypatch.setattr(render.ENVIRONMENT, "loader", jinja2.FileSystemLoader([templates, render.KINDS]))
    drifts = drift.find_drift(project)
    assert drifts == ["gen/mlp_digits/MANIFEST.json: differs from a fresh generation "
                      "(template(s) changed since generation: templates/model.py.j2)",
                      "gen/mlp_digits/model.py: differs from a fresh generation "
                      "(template(s) changed since generation: templates/model.py.j2)"]


def test_stray_file_in_gen_is_caught(project):
    (project / "gen" / "mlp_digits" / "extra.py").write_text("x = 1\n")
    assert drift.find_drift(project) == [
        "gen/mlp_digits/extra.py: not generated from any spec in specs/ (stray file)"]


def test_check_exits_1_and_lists_the_drift(project):
    (project / "gen" / "mlp_digits" / "model.py").write_text("# edited\n")
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "check", "--root", str(project)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "gen/mlp_digits/model.py: differs from a fresh generation" in result.stderr
