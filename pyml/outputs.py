"""How pyml writes what a command makes (a model folder, a checkpoint, a GGUF, a plot): nothing
lost, nothing left behind.

- The destination is checked before the work (`check_destination`): its parent must be a folder
  pyml can write in, and an existing destination that is not the command's own kind of output is
  refused, in one line, unless the user passed --overwrite.
- The output is written into a temporary sibling, `.NAME.PID.tmp`, and renamed into place
  (`written_file`, `written_folder`), so that the old destination is never half-replaced; the
  temporary is removed on any failure, Ctrl-C included.
- A temporary that a killed process left (its PID no longer runs) is removed the next time a
  command writes beside it (`remove_stale_temporaries`), and the command says so.
- A write that fails says why in words, naming ENOSPC for a full disk (`os_error`).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from pyml.errors import PymlError

NEW_FILE_MODE = 0o644  # what a plain open() would give under the usual umask
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)(\.old)?\.tmp$")


def os_error(error: OSError) -> str:
    """What went wrong, in words; a full disk is named as such."""
    if error.errno == errno.ENOSPC:
        return "no space left on the device (ENOSPC)"
    return error.strerror or str(error)


def temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder: Path, name: str | None = None,
                             say: Callable[[str], None] | None = None) -> list[Path]:
    """Remove the temporaries in `folder` (`.NAME.PID.tmp`; of `name` only, when given) whose
    process no longer runs: what a command killed while writing left. Returns them; `say`
    (default: stderr) is told of each."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for candidate in sorted(folder.iterdir()):
        match = _TEMPORARY.match(candidate.name)
        if match is None or (name is not None and match["name"] != name):
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _running(pid):
            continue
        if candidate.is_dir() and not candidate.is_symlink():
            shutil.rmtree(candidate, ignore_errors=True)
        else:
            candidate.unlink(missing_ok=True)
        removed.append(candidate)
        (say or _to_stderr)(f"removed {candidate}, left by an earlier run that was stopped while writing")
    return removed


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def check_destination(path: Path, what: str, is_own_kind: Callable[[Path], bool],
                      overwrite: bool | None, option: str = "--out") -> Path:
    """Refuse, before any work, a destination pyml cannot write or must not replace: `path` is
    to receive `what` (say "a model folder"); an existing `path` that `is_own_kind` accepts is
    replaced (or, for a run, continued), anything else there only with --overwrite (`overwrite`
    None: the command has no such option). Returns `path`."""
    path = Path(path)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PymlError(f"{option} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PymlError(f"{option} {path}: cannot write in {parent} (permission denied)")
    if path.exists() and not overwrite and not is_own_kind(path):
        remedy = "" if overwrite is None else ", or pass --overwrite to replace it"
        raise PymlError(f"{option} {path} already exists and is not {what}: choose another "
                        f"{option}{remedy}")
    return path


@contextmanager
def written_file(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; once the block ends, flush it to disk and
    rename it over `path`. On any exception (Ctrl-C included) the temporary is removed and `path`
    keeps its old content."""
    path = Path(path)
    remove_stale_temporaries(path.parent, path.name)
    temporary = temporary_sibling(path)
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(temporary, NEW_FILE_MODE)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Run `write` on a temporary sibling of `path`, then put it in place (`written_file`):
    readers see the old file or the whole new one."""
    with written_file(path) as temporary, open(temporary, "wb") as handle:
        write(handle)


def write_bytes(path: Path, content: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(content))


@contextmanager
def written_folder(path: Path) -> Iterator[Path]:
    """Yield a new temporary folder beside `path` to fill; once the block ends, put it in place of
    `path` (an existing `path` is moved aside first and deleted after). On any exception (Ctrl-C
    included) the temporary is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, path.name)
    temporary = temporary_sibling(path)
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        _fsync_folder(temporary)
        if path.exists():
            old = path.with_name(f".{path.name}.{os.getpid()}.old.tmp")
            os.replace(path, old)
            os.replace(temporary, path)
            _remove(old)
        else:
            os.replace(temporary, path)
        _fsync_folder(path.parent)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
