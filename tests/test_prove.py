from pyml.laws import LEAN_DIR
from pyml.prove import find_lake, prove


def test_prove_without_a_toolchain_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_lake() is None
    assert prove(LEAN_DIR) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no Lean toolchain found" in err and "elan" in err


def test_prove_runs_lake_build_in_the_lean_dir(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lake = bin_dir / "lake"
    ran = bin_dir / "ran"
    lake.write_text(f'#!/bin/sh\npwd > "{ran}"; echo "$@" >> "{ran}"; exit 3\n')
    lake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert prove(LEAN_DIR) == 3
    assert ran.read_text().split("\n")[:2] == [str(LEAN_DIR), "build"]
