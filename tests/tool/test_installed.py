"""pyml as a user gets it: a wheel of this checkout installed into a fresh virtual environment
and used from folders outside the checkout, with a cache of its own. The checkout is left as it
was, and the installed pyml's folder gets nothing written into it.

The environment reuses the project venv's dependencies (a .pth line naming its site-packages)
and installs the wheel with its [serve] extra as the README's install line says, with pip kept off
any index: the dependencies are found installed, and nothing is downloaded. Slow: it builds a wheel, compiles two
generated packages in a fresh Numba cache, runs SmolLM2-135M twice at once, fine-tunes it for a
step and exports the checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.support import anchors
from tests.support.model_folders import tiny_text

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

TRAINING = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pyml

    m = pyml.compile(sys.argv[1])
    model = m.Model.initialized(seed=0, dtype=np.float64)
    optimizer = m.AdamW(model, lr=1e-2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.model.VOCAB, (2, 9))
    losses = [m.train_step(model, optimizer, ids[:, :-1], ids[:, 1:]) for _ in range(2)]
    print(json.dumps({"losses": losses, "module": m.__name__, "file": m.__file__}))
""")


@dataclass
class Installed:
    root: Path  # a folder outside the checkout: the user's
    python: Path
    pyml: Path
    env: dict
    wheel: Path
    site_packages: Path

    def run(self, *args, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=cwd or self.root, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, *args, cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen([str(a) for a in args], cwd=cwd or self.root, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def readme_install_requirement() -> str:
    """What the README's install line gives pip: the wheel that `pip wheel` writes into dist/,
    with the [serve] extra."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (requirement,) = re.findall(r'^pip install "(dist/[^"]+\.whl\[serve\])"', readme, flags=re.M)
    return requirement


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    anchors.program("git", "apt-get install git")
    if not (ROOT / ".git").exists():
        anchors.missing(f"{ROOT} is not a git checkout: the wheel is built from the files git keeps")
    base = tmp_path_factory.mktemp("installed")
    before = git_status()
    # the wheel is built from a copy of the files git keeps, so the build writes nothing here
    source = base / "source"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for relative in filter(None, listed):
        if (ROOT / relative).is_file():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, source / relative)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--quiet", "-w", str(base / "wheels"), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "wheels").glob("*.whl")
    environment = base / "venv"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    site_packages = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies come from the project's environment, after the venv's own site-packages
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the README's line, `pip install "dist/WHEEL[serve]"`, with the folder the wheel was built in
    requirement = readme_install_requirement().replace("dist/", f"{base / 'wheels'}/", 1)
    installing = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                                 "--no-index", requirement], capture_output=True, text=True, timeout=600)
    assert installing.returncode == 0, installing.stderr
    assert "WARNING" not in installing.stderr, installing.stderr  # e.g. "does not provide the extra"
    user = base / "user"
    user.mkdir()
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "NUMBA_CACHE_DIR", "VIRTUAL_ENV")}
    env |= {"PYML_CACHE": str(base / "cache"), "PATH": f"{environment / 'bin'}:{env['PATH']}"}
    yield Installed(user, python, environment / "bin" / "pyml", env, wheel, site_packages)
    assert git_status() == before, "the checkout changed"
    compiled = [p for p in (site_packages / "pyml").rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert not compiled, f"Numba wrote into the installed pyml: {compiled[:3]}"


def test_the_wheel_holds_pyml_with_its_laws_and_templates_and_no_gen_package(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    for needed in ("pyml/lean/PyML/Laws.lean", "pyml/lean/lakefile.lean", "pyml/lean/lean-toolchain",
                   "pyml/codegen/kinds/attention_cpu.py.j2", "pyml/codegen/templates/model.py.j2",
                   "pyml/project_template/lean/lakefile.lean",
                   "pyml/project_template/specs/my_decoder.toml", "pyml/package/base.py"):
        assert needed in names, needed
    assert not [name for name in names if name.split("/")[0] in ("gen", "lean", "specs", "tests")]
    located = installed.run(installed.python, "-c", "import pyml; print(pyml.__file__)")
    assert Path(located.stdout.strip()).is_relative_to(installed.site_packages)


def test_a_project_made_by_init_generates_and_checks_its_specs(installed):
    project = installed.root / "project"
    made = installed.run(installed.pyml, "init", project)
    assert made.returncode == 0, made.stderr
    shutil.copy(ROOT / "specs" / "mlp_digits.toml", project / "specs" / "digits.toml")
    for spec in ("specs/my_decoder.toml", "specs/digits.toml"):
        generated = installed.run(installed.pyml, "gen", spec, cwd=project)
        assert generated.returncode == 0, generated.stderr
    assert (project / "gen" / "my_decoder" / "model.py").is_file()
    assert (project / "lean" / "Generated" / "MyDecoder.lean").is_file()
    checked = installed.run(installed.pyml, "check", cwd=project / "specs")  # found from below too
    assert checked.returncode == 0, checked.stderr
    (project / "gen" / "my_decoder" / "model.py").write_text("# edited\n")
    assert installed.run(installed.pyml, "check", cwd=project).returncode == 1
    generated = installed.run(installed.pyml, "gen", "specs/my_decoder.toml", cwd=project)
    assert generated.returncode == 0, generated.stderr


@pytest.mark.parametrize("args, message", [
    (["check"], "no pyml project in"),
    (["check", "--root", "/does/not/exist"], "/does/not/exist: no such folder"),
    (["gen", "missing.toml"], "missing.toml"),
    (["init", "."], "is not an empty folder"),
])
def test_refusals_outside_a_project_are_one_line(installed, args, message):
    (installed.root / "not-empty").mkdir(exist_ok=True)
    (installed.root / "not-empty" / "file").write_text("x")
    result = installed.run(installed.pyml, *args, cwd=installed.root / "not-empty")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_compile_trains_as_this_checkout_does_from_a_project_and_from_anywhere(installed):
    spec = installed.root / "project" / "specs" / "my_decoder.toml"
    loose = installed.root / "loose" / "my_decoder.toml"
    loose.parent.mkdir()
    shutil.copy(spec, loose)
    runs = {}
    for name, path in (("project", spec), ("loose", loose)):
        result = installed.run(installed.python, "-c", TRAINING, path)
        assert result.returncode == 0, result.stderr
        # each a package of its own folder, compiled on its first use: said on stderr
        assert "compiling kernels for my_decoder (first use)...\n" in result.stderr
        runs[name] = json.loads(result.stdout.splitlines()[-1])
    assert runs["project"]["file"].startswith(str(installed.root / "project" / "gen"))
    assert runs["loose"]["file"].startswith(installed.env["PYML_CACHE"])
    # the same spec generated and run by this checkout's pyml
    import tomllib

    from pyml.packages import derived_package

    _, package = derived_package(tomllib.loads(loose.read_text()), cache=installed.root / "checkout-cache")
    model = package.Model.initialized(seed=0, dtype=np.float64)
    optimizer = package.AdamW(model, lr=1e-2)
    ids = np.random.default_rng(0).integers(0, package.model.VOCAB, (2, 9))
    expected = [package.train_step(model, optimizer, ids[:, :-1], ids[:, 1:]) for _ in range(2)]
    for run in runs.values():
        assert run["losses"] == pytest.approx(expected, rel=1e-12, abs=0)


IMPORTED_STEP = TRAINING.replace("m = pyml.compile(sys.argv[1])", "sys.path.insert(0, '.'); import gen.my_decoder as m")


def test_import_gen_and_compile_share_a_projects_package_in_either_order(installed):
    """`import gen.my_decoder` in a project, and `pyml.compile` (the `pyml` commands' way) on its
    spec, in separate processes, one after the other in both orders (the first project's package
    was compiled by the test above): each runs and trains alike (the two names once shared
    Numba's cache entries, and whichever came second failed)."""
    runs = []
    for project, order in (("project", ("import", "compile")),
                           ("second-project", ("import", "compile", "import"))):
        folder = installed.root / project
        if not folder.exists():  # `pyml init` generates its example spec's package itself
            made = installed.run(installed.pyml, "init", folder)
            assert made.returncode == 0, made.stderr
            assert (folder / "gen" / "my_decoder" / "model.py").is_file()
        for how in order:
            code = IMPORTED_STEP if how == "import" else TRAINING
            result = installed.run(installed.python, "-c", code, "specs/my_decoder.toml", cwd=folder)
            assert result.returncode == 0, f"{project}, {how}: {result.stderr}"
            run = json.loads(result.stdout.splitlines()[-1])
            assert run["module"] == "gen.my_decoder" if how == "import" else run["module"].startswith("pyml_project_")
            runs.append(run)
    assert all(run["losses"] == runs[0]["losses"] for run in runs)


def test_a_corrupt_cache_entry_is_generated_again(installed):
    entries = sorted((Path(installed.env["PYML_CACHE"]) / "packages").glob("my_decoder-*"))
    assert len(entries) == 1
    model = entries[0] / "gen" / "my_decoder" / "model.py"
    whole = model.read_text()
    model.write_text(whole.replace("def ", "def broken_", 1))
    assert model.read_text() != whole  # the corruption happened
    result = installed.run(installed.python, "-c", TRAINING, installed.root / "loose" / "my_decoder.toml")
    assert result.returncode == 0, result.stderr
    assert model.read_text() == whole
    listed = installed.run(installed.pyml, "cache", "list")
    assert listed.returncode == 0 and "my_decoder" in listed.stdout


def test_import_a_gguf_under_any_name_then_two_chats_at_once(installed):
    """The spec is named after the folder and generated on first use: two processes asking for it
    at once both answer, with one package in the cache."""
    from pyml.formats.smollm2_gguf import shipped_gguf_path

    imported = installed.run(installed.pyml, "import-gguf", shipped_gguf_path(), "--out", "My Model")
    assert imported.returncode == 0, imported.stderr
    ask = [installed.pyml, "generate", "--model", "My Model", "--chat", "--prompt",
           "What is the capital of France?", "--max-new-tokens", "12"]
    chats = [installed.start(*ask) for _ in range(2)]
    answers = [chat.communicate(timeout=900) for chat in chats]
    for chat, (out, err) in zip(chats, answers):
        assert chat.returncode == 0, err
        assert out.strip().startswith("The capital of France is Paris"), out
    assert len(list((Path(installed.env["PYML_CACHE"]) / "packages").glob("my_model-*"))) == 1


def test_fine_tune_the_imported_model_chat_with_it_and_export_it(installed):
    """The rest of the README's loop, on the folder imported under any name: a short fine-tune on
    the user's text, a chat with its checkpoint, and the checkpoint exported to a GGUF that gguf's
    reader reads back."""
    import gguf

    text = tiny_text(installed.root / "my_texts.txt")
    trained = installed.run(installed.pyml, "train", "--init", "My Model", "--data", text, "--steps", "1",
                            "--batch", "1", "--seq", "32", "--eval-batches", "1", "--out", "runs/mine")
    assert trained.returncode == 0, trained.stderr
    checkpoint = installed.root / "runs" / "mine" / "step_000001"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "spec.toml").is_file()
    chat = installed.run(installed.pyml, "generate", "--model", checkpoint, "--chat", "--prompt",
                         "What is the capital of France?", "--max-new-tokens", "8")
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    exported = installed.run(installed.pyml, "export-gguf", checkpoint, "--out", "mine.q8_0.gguf",
                             "--type", "q8_0")
    assert exported.returncode == 0, exported.stderr
    reader = gguf.GGUFReader(installed.root / "mine.q8_0.gguf")
    assert reader.get_field("general.architecture").contents() == "llama"
    kinds = {tensor.tensor_type for tensor in reader.tensors}
    assert kinds == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32}  # norms: float32


def test_cache_clear_empties_it(installed):
    cleared = installed.run(installed.pyml, "cache", "clear")
    assert cleared.returncode == 0 and "removed 2 package(s)" in cleared.stdout, cleared.stdout
    assert not (Path(installed.env["PYML_CACHE"]) / "packages").exists()
    assert installed.run(installed.pyml, "cache", "list").stdout.startswith("0 package(s)")
