"""The CLI as a user runs it: a subprocess, its exit status and what it prints."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyml.project import init_project

ROOT = Path(__file__).resolve().parents[2]
PYML = [sys.executable, "-m", "pyml.cli"]
BAD_SPECS = sorted((ROOT / "specs" / "bad").glob("*.toml"))


def pyml(*args, cwd=ROOT):
    return subprocess.run([*PYML, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_help_lists_the_commands():
    result = pyml("--help")
    assert result.returncode == 0
    for command in ("gen", "check", "prove"):
        assert command in result.stdout


def test_version_and_short_help():
    version = pyml("--version")
    assert version.returncode == 0 and version.stdout == "pyml 0.1.0\n"
    assert pyml("-h").stdout == pyml("--help").stdout
    assert pyml("serve", "-h").stdout == pyml("serve", "--help").stdout


@pytest.mark.parametrize("command, usage", [
    (["init"], "init [OPTIONS] FOLDER"),
    (["gen"], "gen [OPTIONS] SPECS..."),
    (["import-gguf"], "import-gguf [OPTIONS] [PATH]"),
    (["import-hf"], "import-hf [OPTIONS] FOLDER"),
    (["merge-lora"], "merge-lora [OPTIONS] BASE ADAPTER"),
    (["train"], "train [OPTIONS]"),
    (["cache", "list"], "cache list [OPTIONS]"),
])
def test_help_reads_as_click_writes_it(command, usage):
    """Arguments in capitals in the usage line (typer 0.29 writes `{folder}`), no type beside a
    flag, which takes no value (it writes `--resume <bool>`), several paths as `<path>`."""
    result = subprocess.run([*PYML, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                            env=os.environ | {"COLUMNS": "100"}, timeout=600)
    assert result.returncode == 0
    usage_line = result.stdout.splitlines()[1]
    assert f" {usage} " in usage_line  # after the program's name
    assert "{" not in usage_line
    for wrong in ("<bool>", "list["):
        assert wrong not in result.stdout, wrong


def test_the_seed_mismatch_message():
    result = pyml("gen", "specs/bad/mlp_128_to_64.toml")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: specs/bad/mlp_128_to_64.toml: shape mismatch between 'fc1' and 'fc2': "
        "expected Mat<B, 64>, observed Mat<B, 128>"
    )
    assert result.stdout == ""


@pytest.mark.parametrize("path", BAD_SPECS, ids=lambda p: p.name)
def test_every_bad_spec_exits_2_with_one_line(path):
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    result = pyml("gen", str(path.relative_to(ROOT)))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


def test_a_bad_spec_among_good_ones_writes_nothing(tmp_path):
    init_project(tmp_path)
    shutil.copytree(ROOT / "specs", tmp_path / "specs", dirs_exist_ok=True)
    result = pyml("gen", "specs/mlp_digits.toml", "specs/bad/mlp_128_to_64.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert not (tmp_path / "gen").exists()


@pytest.mark.parametrize("user_setting", [None, ("GOMP_SPINCOUNT", "50"), ("OMP_WAIT_POLICY", "ACTIVE")])
def test_benchmarks_start_from_the_users_thread_environment(user_setting):
    # pyml sets thread-pool variables on import; `pyml bench` must hand its scripts (and so
    # PyTorch's worker) the environment the user gave, with a user's own choice of libgomp's
    # waiting kept (and then no spin count of pyml's)
    code = ("import os, pyml; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
            "pyml.user_environment().get('OMP_WAIT_POLICY'), pyml.user_environment().get('GOMP_SPINCOUNT'))")
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    if user_setting:
        environment[user_setting[0]] = user_setting[1]
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                            text=True, check=True)
    # pyml's spin count is for numba's libgomp alone, set while it loads and removed after
    expected = {None: ["PASSIVE", "None", "None", "None"], "GOMP_SPINCOUNT": ["None", "50", "None", "50"],
                "OMP_WAIT_POLICY": ["ACTIVE", "None", "ACTIVE", "None"]}
    assert result.stdout.split() == expected[user_setting and user_setting[0]]
