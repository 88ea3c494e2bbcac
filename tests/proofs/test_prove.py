from pathlib import Path

import pytest

from pyml.errors import PymlError
from pyml.project import LAWS_COPY, LAWS_DIR, init_project
from pyml.prove import find_lake, prove


def test_prove_without_a_toolchain_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_lake() is None
    assert prove(None) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no Lean toolchain found" in err and "elan" in err


def fake_lake(tmp_path: Path, monkeypatch, status: int) -> Path:
    """A `lake` that records where it ran and exits with `status`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lake, ran = bin_dir / "lake", bin_dir / "ran"
    lake.write_text(f'#!/bin/sh\npwd >> "{ran}"; echo "$@" >> "{ran}"; exit {status}\n')
    lake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return ran


def test_prove_builds_the_laws_then_the_projects_instances(tmp_path, monkeypatch):
    project = tmp_path / "project"
    init_project(project)
    ran = fake_lake(tmp_path, monkeypatch, 0)
    assert prove(project) == 0
    lean = project / "lean"
    assert ran.read_text().split("\n")[:4] == [str(lean / LAWS_COPY), "build", str(lean), "build"]
    # the lakefile requires the copy, which holds the installed pyml's laws
    assert (lean / LAWS_COPY / "PyML" / "Laws.lean").read_bytes() == (LAWS_DIR / "PyML" / "Laws.lean").read_bytes()
    assert '"."/".pyml-laws"' in (lean / "lakefile.lean").read_text()


def test_prove_stops_at_the_first_failed_build(tmp_path, monkeypatch):
    project = tmp_path / "project"
    init_project(project)
    ran = fake_lake(tmp_path, monkeypatch, 3)
    assert prove(project) == 3
    assert ran.read_text().split("\n")[:2] == [str(project / "lean" / LAWS_COPY), "build"]


def test_prove_outside_a_project_builds_the_laws_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYML_CACHE", str(tmp_path / "cache"))
    ran = fake_lake(tmp_path, monkeypatch, 0)
    assert prove(None) == 0
    assert ran.read_text().split("\n")[:2] == [str(tmp_path / "cache" / "lean-laws"), "build"]
    assert (tmp_path / "cache" / "lean-laws" / "PyML.lean").is_file()


def test_a_project_pinned_to_another_lean_is_refused(tmp_path, monkeypatch):
    project = tmp_path / "project"
    init_project(project)
    (project / "lean" / "lean-toolchain").write_text("leanprover/lean4:v4.0.0\n")
    fake_lake(tmp_path, monkeypatch, 0)
    with pytest.raises(PymlError, match="pins leanprover/lean4:v4.0.0, pyml's laws need"):
        prove(project)
