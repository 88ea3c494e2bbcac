"""Where a spec's generated package comes from (`pyml.packages`): a project's gen/ when it is
current for that very spec, else pyml's cache, generated once, whole, and again when corrupted."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyml.codegen.emit import write_generated
from pyml.errors import PymlError
from pyml.generate import decoding as generation
from pyml.packages import cached_package, package_for
from pyml.project import init_project
from pyml.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "llama_tiny.toml"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PYML_CACHE", str(folder))
    return folder


@pytest.fixture
def project(tmp_path) -> Path:
    """A project holding llama_tiny's spec and its generated package."""
    root = tmp_path / "project"
    init_project(root)
    spec_path = root / "specs" / "llama_tiny.toml"
    shutil.copy(SPEC, spec_path)
    write_generated(load_spec(spec_path), spec_path, root)
    return root


def test_a_projects_current_package_runs_and_a_stale_one_does_not(project, cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec_path = project / "specs" / "llama_tiny.toml"
    assert Path(package_for(spec_path).__file__).is_relative_to(project / "gen")
    spec_path.write_text(spec_path.read_text().replace("theta = 50000.0", "theta = 40000.0"))
    stale = package_for(spec_path)  # the project's package was generated from the old spec
    assert Path(stale.__file__).is_relative_to(cache)
    assert stale.model.__file__ != package_for(SPEC).model.__file__


def test_a_model_folders_spec_runs_from_the_project_around_the_working_directory(
        project, cache, tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(SPEC, folder / "spec.toml")
    monkeypatch.chdir(project / "specs")
    assert Path(package_for(folder).__file__).is_relative_to(project / "gen")
    monkeypatch.chdir(tmp_path)  # no project here: the same spec from the cache
    assert Path(package_for(folder).__file__).is_relative_to(cache)
    assert len(list((cache / "packages").iterdir())) == 1


def with_one_letter_changed(path: Path) -> bytes:
    """Swap the case of one letter in the middle of `path`, a one-byte edit that keeps the file
    valid UTF-8 (so only its hash can tell); returns the file as it was."""
    whole = path.read_bytes()
    at = next(i for i in range(len(whole) // 2, len(whole)) if whole[i:i + 1].isalpha())  # ASCII only
    path.write_bytes(whole[:at] + whole[at:at + 1].swapcase() + whole[at + 1:])
    assert path.read_bytes() != whole and len(path.read_bytes()) == len(whole)
    return whole


@pytest.mark.parametrize("corruption", ["one byte changed", "a file deleted"])
def test_a_corrupt_entry_is_set_aside_and_generated_again(cache, corruption):
    spec = load_spec(SPEC)
    entry, _ = cached_package(spec, SPEC.read_text())
    corrupted = entry / "gen" / "llama_tiny" / "kernels_cpu.py"
    if corruption == "one byte changed":
        whole = with_one_letter_changed(corrupted)
    else:
        whole = corrupted.read_bytes()
        corrupted.unlink()
    again, _ = cached_package(spec, SPEC.read_text())
    assert again == entry and corrupted.read_bytes() == whole
    assert [p.name for p in (cache / "packages").iterdir()] == [entry.name]  # nothing set aside left


def test_a_project_package_with_one_byte_changed_is_not_used(project, cache, tmp_path, monkeypatch):
    """`pyml.compile` of a project's spec whose gen/ package was edited (one byte, nothing deleted)
    runs the spec's package from the cache instead."""
    import pyml

    monkeypatch.chdir(tmp_path)
    spec_path = project / "specs" / "llama_tiny.toml"
    assert Path(pyml.compile(spec_path).__file__).is_relative_to(project / "gen")
    with_one_letter_changed(project / "gen" / "llama_tiny" / "model.py")
    fallback = pyml.compile(spec_path)
    assert not Path(fallback.__file__).is_relative_to(project)
    # generated into this test's cache (an earlier test may have imported the same entry's module)
    [entry] = (cache / "packages").iterdir()
    assert entry.name.startswith("llama_tiny-") and fallback.__name__.startswith("pyml_generated_llama_tiny_")


def test_processes_generating_the_same_spec_at_once_leave_one_whole_entry(cache):
    code = textwrap.dedent(f"""
        from pathlib import Path
        from pyml.packages import cached_package
        from pyml.spec import load_spec
        entry, package = cached_package(load_spec(Path({str(SPEC)!r})), Path({str(SPEC)!r}).read_text())
        print(entry)
    """)
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=os.environ.copy()) for _ in range(3)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1
    assert [p.name for p in (cache / "packages").iterdir()] == [Path(outputs[0][0].strip()).name]


# One training step of the project's llama_tiny, its package imported as a user imports it
# (`import gen.llama_tiny` from the project) or as the `pyml` command does (`pyml.compile`).
ONE_STEP = textwrap.dedent("""
    import json, sys
    import numpy as np
    project, how = sys.argv[1], sys.argv[2]
    if how == "import":
        sys.path.insert(0, project)
        import gen.llama_tiny as m
    else:
        import pyml
        m = pyml.compile(project + "/specs/llama_tiny.toml")
    model = m.Model.initialized(seed=0, dtype=np.float32)
    ids = np.random.default_rng(0).integers(0, m.model.VOCAB, (2, 9))
    loss = m.train_step(model, m.AdamW(model, lr=1e-2), ids[:, :-1], ids[:, 1:])
    print(json.dumps({"module": m.__name__, "loss": loss}))
""")


def test_a_package_imported_under_two_names_runs_in_either_order_from_a_cold_cache(
        project, cache, tmp_path):
    """Numba's cache pickles the module name of what it compiled: a kernels file imported under two
    names must not share entries (it did: ModuleNotFoundError: No module named 'gen'). The
    command's name after the user's, then the user's again, which reads its own entries after the
    other name wrote beside them (test_installed.py runs the other order too)."""
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = []
    for how in ("import", "compile", "import"):
        result = subprocess.run([sys.executable, "-c", ONE_STEP, str(project), how], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        runs.append(json.loads(result.stdout.splitlines()[-1]))
    assert runs[0]["module"] != runs[1]["module"] and runs[0]["module"] == runs[2]["module"]
    assert runs[0]["loss"] == runs[1]["loss"] == runs[2]["loss"]
    assert any(tmp_path.joinpath("numba").rglob("*.nbi"))  # the cache was used, not bypassed


def test_an_unwritable_cache_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PYML_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.chdir(tmp_path)
    shutil.copy(SPEC, tmp_path / "spec.toml")
    with pytest.raises(PymlError, match=r"^cannot write pyml's cache .*; set PYML_CACHE to a "
                                        r"writable folder$"):
        package_for(tmp_path / "spec.toml")


def test_a_renamed_model_folder_runs_from_a_package_generated_on_first_use(tiny_folders, cache, tmp_path):
    """A folder's spec under a name no project has (as `pyml import-gguf --out ANY_NAME` writes)
    is generated into the cache and runs the folder's weights."""
    folder = tmp_path / "My Gemma"
    shutil.copytree(tiny_folders["gemma3"], folder)
    spec_text = (folder / "spec.toml").read_text()
    name = load_spec(folder / "spec.toml").name
    (folder / "spec.toml").write_text(spec_text.replace(f'"{name}"', '"my_gemma"'))
    renamed = generation.load_model(folder)
    assert Path(sys.modules[type(renamed).__module__].__file__).is_relative_to(cache)
    original = generation.load_model(tiny_folders["gemma3"])
    np.testing.assert_array_equal(renamed.device.to_host(renamed.params.flat),
                                  original.device.to_host(original.params.flat))


def test_gen_of_a_spec_outside_any_project_writes_into_the_cache(cache, tmp_path):
    spec_path = tmp_path / "loose" / "mine.toml"
    spec_path.parent.mkdir()
    spec_path.write_text(SPEC.read_text().replace('"llama_tiny"', '"mine"'))
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "gen", str(spec_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "is in no pyml project" in result.stdout and "pyml.compile" in result.stdout
    [entry] = (cache / "packages").iterdir()
    assert entry.name.startswith("mine-") and (entry / "gen" / "mine" / "model.py").is_file()
    assert not (tmp_path / "gen").exists() and not (spec_path.parent / "gen").exists()
