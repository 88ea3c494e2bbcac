"""Nothing lost, nothing left behind (pyml/outputs.py), and every bad value refused in one line.

Each command that writes a model folder, checkpoint or file checks its destination before any
work, refuses one that is not its own kind of output unless --overwrite is given, writes into a
temporary sibling that it renames into place, and removes the temporaries a killed run left.
Bad values are refused before a model is loaded, with one line and exit status 2; Ctrl-C and
SIGTERM end `pyml train` with 130 and 143 after it saved.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pyml.errors import PymlError
from pyml.train.checkpoint import list_checkpoints
from tests.support.model_folders import tiny_text, tiny_training

ROOT = Path(__file__).resolve().parents[2]


def pyml(*args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`pyml ARGS` in `cwd`; an argument may be bytes (what a shell passes that is not UTF-8)."""
    arguments = [a if isinstance(a, bytes) else str(a) for a in args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pyml.cli", *arguments], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones included) and a hash of its content."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def dead_pid() -> int:
    """The PID of a process that has ended: what a temporary left by a killed run carries."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@dataclass
class User:
    """A user's folder: tiny imported models of both families, a LoRA adapter of the llama, a
    checkpoint of a full fine-tune of it, and a few files of their own."""

    root: Path
    llama: Path
    gemma: Path
    llama_gguf: Path
    adapter: Path
    checkpoint: Path


@pytest.fixture(scope="module")
def user(tiny_folders, tmp_path_factory) -> User:
    root = tmp_path_factory.mktemp("user")
    llama = tiny_folders["llama"]
    adapter = tiny_training(llama, root / "lora-run", lora_rank=2, steps=2).checkpoint
    checkpoint = tiny_training(llama, root / "full-run", steps=2).checkpoint
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("my own notes\n")
    (root / "a-file").write_text("not a folder\n")
    return User(root, llama, tiny_folders["gemma3"], llama.parent / "tiny-llama.gguf", adapter,
                checkpoint)


REFUSALS = {
    # bad values, refused before any model is loaded
    "prompt-not-utf8": (lambda u: ["generate", "--model", u.llama, "--prompt", b"\xff\xfe abc"],
                        "--prompt is not UTF-8 text (byte 0xff at position 0)"),
    "temperature-nan": (lambda u: ["generate", "--model", u.llama, "--temperature", "nan"],
                        "--temperature must be a number >= 0 (0: greedy), not nan"),
    "temperature-inf": (lambda u: ["generate", "--model", u.llama, "--temperature", "inf"],
                        "--temperature must be a number >= 0 (0: greedy), not inf"),
    "top-p-nan": (lambda u: ["generate", "--model", u.llama, "--top-p", "nan"],
                  "--top-p must be a number in (0, 1], not nan"),
    "weight-decay-inf": (lambda u: ["train", "--init", u.llama, "--weight-decay", "inf", "--out",
                                    u.root / "new-run"],
                         "--weight-decay must be a finite number >= 0, got inf"),
    "lr-nan": (lambda u: ["train", "--init", u.llama, "--lr", "nan", "--out", u.root / "new-run"],
               "--lr must be a positive number, got nan"),
    "precision-unknown": (lambda u: ["train", "--init", u.llama, "--precision", "fp8", "--out", u.root / "new-run"],
                          "--precision must be f32 or bf16, got 'fp8'"),
    "precision-bf16-float64": (lambda u: ["train", "--init", u.llama, "--precision", "bf16", "--dtype", "float64",
                                          "--out", u.root / "new-run"],
                               "--precision bf16 keeps float32 master weights: use --dtype float32, not float64"),
    "peer-timeout-inf": (lambda u: ["train", "--init", u.llama, "--peer-timeout", "inf"],
                         "--peer-timeout must be a number of seconds > 0, not inf"),
    "check-missing-root": (lambda u: ["check", "--root", u.root / "missing"], "missing: no such folder"),
    # outputs checked before the work
    "train-out-under-a-file": (lambda u: ["train", "--init", u.llama, "--out", u.root / "a-file" / "run"],
                               "a-file is not a folder"),
    "train-out-not-a-run": (lambda u: ["train", "--init", u.llama, "--out", u.root / "notes"],
                            "notes already exists and is not a training run"),
    "import-over-a-checkpoint": (lambda u: ["import-gguf", u.llama_gguf, "--out", u.checkpoint],
                                 "already exists and is not a model folder: choose another --out, "
                                 "or pass --overwrite"),
    "merge-over-a-checkpoint": (lambda u: ["merge-lora", u.llama, u.adapter, "--out", u.checkpoint],
                                "already exists and is not a model folder"),
    "merge-over-notes": (lambda u: ["merge-lora", u.llama, u.adapter, "--out", u.root / "notes"],
                         "notes already exists and is not a model folder"),
    "export-over-a-text-file": (lambda u: ["export-gguf", u.llama, "--out", u.root / "notes" / "todo.txt"],
                                "todo.txt already exists and is not a GGUF file"),
    # messages that say what to do
    "adapter-as-model": (lambda u: ["generate", "--model", u.adapter, "--prompt", "hi"],
                         "holds LoRA adapters, not a model: give its base as --model and --adapter"),
    "adapter-exported": (lambda u: ["export-gguf", u.adapter, "--out", u.root / "adapter.gguf"],
                         "holds LoRA adapters, not a model: fold them into their base first "
                         "(`pyml merge-lora BASE ADAPTER --out DIR`)"),
    "spec-does-not-fit-init": (lambda u: ["train", "--spec", ROOT / "specs" / "llama_tiny.toml",
                                          "--init", u.gemma, "--seq", "100000", "--out", u.root / "r"],
                               "tiny-gemma3"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_input_is_refused_in_one_line_and_nothing_is_written(user, case):
    arguments, message = REFUSALS[case]
    before = snapshot(user.root)
    result = pyml(*arguments(user), cwd=user.root)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "--seq" not in lines[0] or case != "spec-does-not-fit-init"
    assert snapshot(user.root) == before


def test_bf16_is_refused_where_the_cpu_lacks_it(monkeypatch):
    """A CPU without AVX-512 BF16 (or a GPU run) is told in one line, before anything loads."""
    from pyml.package.base import check_precision
    from pyml.package.bf16_products import has_bf16_products

    if has_bf16_products():
        check_precision("bf16", "float32", "cpu")
    monkeypatch.setattr("pyml.package.bf16_products.has_bf16_products", lambda: False)
    with pytest.raises(PymlError, match="needs a CPU with AVX-512 BF16"):
        check_precision("bf16", "float32", "cpu")
    with pytest.raises(PymlError, match="runs on the CPU only"):
        check_precision("bf16", "float32", "cuda")


def test_import_replaces_a_model_folder_whole(user, tmp_path):
    folder = tmp_path / "model"
    assert pyml("import-gguf", user.llama_gguf, "--out", folder, cwd=tmp_path).returncode == 0
    first = snapshot(folder)
    (folder / "stale.txt").write_text("left from before\n")
    again = pyml("import-gguf", user.llama_gguf, "--out", folder, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert snapshot(folder) == first
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_merge_into_an_imported_folder_leaves_no_source_gguf(user, tmp_path):
    """The old source.gguf (a link to the imported GGUF) would make `pyml generate` decode on the
    weights before the merge: the merged folder holds its own GGUF instead, as a fresh merge's."""
    folder = tmp_path / "model"
    assert pyml("import-gguf", user.llama_gguf, "--out", folder, cwd=tmp_path).returncode == 0
    assert (folder / "source.gguf").is_symlink()
    merged = pyml("merge-lora", user.llama, user.adapter, "--out", folder, cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr
    assert (folder / "source.gguf").is_file() and not (folder / "source.gguf").is_symlink()
    reference = tmp_path / "reference"
    assert pyml("merge-lora", user.llama, user.adapter, "--out", reference, cwd=tmp_path).returncode == 0
    assert snapshot(folder) == snapshot(reference)


def test_overwrite_replaces_what_is_not_its_own_kind(user, tmp_path):
    target = tmp_path / "checkpoint-copy"
    target.mkdir()
    (target / "state.json").write_text("{}")
    result = pyml("import-gguf", user.llama_gguf, "--out", target, "--overwrite", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (target / "state.json").exists() and (target / "source.gguf").is_file()


def test_import_links_the_gguf_or_copies_it_and_a_moved_gguf_is_said_in_one_line(user, tmp_path):
    """source.gguf is a link to the GGUF (no second copy); once the GGUF is moved, a command on the
    folder says so in one line, exit 2; --copy makes a folder that outlives the move."""
    gguf_path = tmp_path / "tiny.gguf"
    gguf_path.write_bytes(user.llama_gguf.read_bytes())
    # named as the tiny llama's folder is: the spec, named after its folder, is that model's, whose
    # compiled package the suite already has (a spec of another name compiles its own, 15 s)
    linked, copied = tmp_path / "linked" / user.llama.name, tmp_path / "copied" / user.llama.name
    made = pyml("import-gguf", gguf_path, "--out", linked, cwd=tmp_path)
    assert made.returncode == 0 and f"source.gguf, a link to {gguf_path.resolve()}" in made.stdout
    assert (linked / "source.gguf").readlink() == gguf_path.resolve()
    assert "model.safetensors" not in {path.name for path in linked.iterdir()}
    assert pyml("import-gguf", gguf_path, "--out", copied, "--copy", cwd=tmp_path).returncode == 0
    assert not (copied / "source.gguf").is_symlink()
    assert (copied / "source.gguf").read_bytes() == gguf_path.read_bytes()

    gguf_path.rename(tmp_path / "moved.gguf")
    ask = ["--prompt", "the", "--max-new-tokens", "2"]
    moved = pyml("generate", "--model", linked, *ask, cwd=tmp_path)
    assert moved.returncode == 2 and moved.stderr.count("\n") == 1, moved.stderr
    assert (f"source.gguf: the GGUF it points to, {gguf_path.resolve()}, is missing: it was moved "
            "or deleted; import it again") in moved.stderr
    assert pyml("generate", "--model", copied, *ask, cwd=tmp_path).returncode == 0


def test_import_refuses_a_gguf_inside_the_folder_it_replaces(user, tmp_path):
    folder = tmp_path / "model"
    assert pyml("import-gguf", user.llama_gguf, "--out", folder, "--copy", cwd=tmp_path).returncode == 0
    again = pyml("import-gguf", folder / "source.gguf", "--out", folder, cwd=tmp_path)
    assert again.returncode == 2 and "is inside --out" in again.stderr, again.stderr
    assert (folder / "source.gguf").is_file()


def test_stale_temporaries_are_removed_at_the_next_run_and_said(user, tmp_path):
    """What a run killed while writing (kill -9: nothing could clean up) left beside its outputs."""
    out = tmp_path / "run"
    out.mkdir()
    pid = dead_pid()
    (out / f".loss.png.{pid}.tmp").write_bytes(b"")
    (out / f".step_000002.{pid}.tmp").mkdir()
    (out / f".step_000002.{pid}.tmp" / "model.safetensors").write_bytes(b"half")
    result = pyml("train", "--spec", ROOT / "specs" / "llama_tiny.toml", "--init", user.llama, "--data",
                  tiny_text(tmp_path / "text.txt"), "--steps", "1", "--batch", "1", "--seq", "16",
                  "--eval-batches", "1", "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in out.iterdir()) == ["loss.png", "metrics.jsonl", "step_000001"]
    assert result.stderr.count("left by an earlier run that was stopped while writing") == 2


def test_only_temporaries_of_ended_processes_are_removed(tmp_path):
    """Another process that is still writing keeps its temporary; so does this one."""
    from pyml.outputs import remove_stale_temporaries

    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f".model.gguf.{pid}.tmp" for pid in (writer.pid, os.getpid(), dead_pid())]
        names += [".model.gguf.tmp", f".other.gguf.{dead_pid()}.tmp"]  # not pyml's; another name
        for name in names:
            (tmp_path / name).write_bytes(b"")
        removed = remove_stale_temporaries(tmp_path, "model.gguf", say=lambda message: None)
    finally:
        writer.kill()
        writer.wait()
    assert [path.name for path in removed] == [names[2]]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names[:2] + names[3:])


@pytest.mark.slow
def test_a_killed_export_leaves_a_temporary_that_the_next_export_removes(smollm2_folder, tmp_path):
    out = tmp_path / "model.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    export = subprocess.Popen([sys.executable, "-m", "pyml.cli", "export-gguf", str(smollm2_folder),
                               "--out", str(out), "--type", "f32"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temporary = tmp_path / f".model.gguf.{export.pid}.tmp"
    deadline = time.monotonic() + 300
    while not (temporary.is_file() and temporary.stat().st_size > 0) and time.monotonic() < deadline:
        assert export.poll() is None, "the export ended before it could be killed"
        time.sleep(0.01)
    export.send_signal(signal.SIGKILL)
    export.wait()
    assert temporary.is_file() and not out.exists()
    again = pyml("export-gguf", smollm2_folder, "--out", out, "--type", "q8_0", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"removed {temporary}" in again.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.gguf"]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_saving_a_checkpoint_is_named_and_leaves_nothing(user, tmp_path, monkeypatch):
    from pyml.train import checkpoint

    monkeypatch.setattr(checkpoint, "write_json", full_disk)
    with pytest.raises(PymlError, match=r"step_000002: cannot write the checkpoint: no space left on "
                                        r"the device \(ENOSPC\)"):
        tiny_training(user.llama, tmp_path / "run", steps=2)
    assert list_checkpoints(tmp_path / "run") == []
    assert not [path for path in (tmp_path / "run").iterdir() if path.name.startswith(".")]


def test_a_full_disk_while_exporting_is_named_and_keeps_the_old_file(user, tmp_path, monkeypatch):
    from pyml.formats import gguf_export

    out = tmp_path / "model.gguf"
    gguf_export.export_gguf(user.llama, out, "f32", progress=False)
    before = out.read_bytes()
    monkeypatch.setattr(gguf_export, "_write", full_disk)
    with pytest.raises(PymlError, match=r"model.gguf: cannot write: no space left on the device "
                                        r"\(ENOSPC\)"):
        gguf_export.export_gguf(user.llama, out, "q8_0", progress=False)
    assert out.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_saves_and_exits_with_the_signals_status(tmp_path, signum, status):
    """A script can tell that the run stopped early, though it saved the step in flight."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.Popen(
        [sys.executable, "-m", "pyml.cli", "train", "--spec", str(ROOT / "specs" / "mlp_digits.toml"),
         "--steps", "100000", "--checkpoint-every", "100000", "--eval-every", "100000", "--out", "run"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in run.stdout:  # the baseline evaluation is written when training starts
        if line.startswith("step 0"):
            break
    time.sleep(0.5)
    run.send_signal(signum)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == status, stderr[-2000:]
    assert len(list_checkpoints(tmp_path / "run")) == 1
    assert "saving a checkpoint after this step" in stdout + stderr


def test_a_spec_whose_tables_exceed_memory_is_refused_in_one_line(tmp_path):
    """max_seq_len sizes the RoPE tables: 10^10 positions are terabytes. `pyml gen` says so, and
    building the model refuses it before allocating."""
    from pyml import compile as compile_spec

    spec = (ROOT / "specs" / "llama_tiny.toml").read_text().replace("max_seq_len = 64",
                                                                   "max_seq_len = 10000000000")
    assert "max_seq_len = 10000000000" in spec
    path = tmp_path / "huge.toml"
    path.write_text(spec.replace('name = "llama_tiny"', 'name = "huge"'))
    generated = pyml("gen", path, cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert "RoPE tables" in generated.stdout and "more than the" in generated.stdout
    package = compile_spec(path)
    with pytest.raises(PymlError, match=r"spec 'huge' \(.* and RoPE tables of 10,000,000,000 positions\) "
                                        r"needs [0-9.]+ GiB but"):
        package.Model()
