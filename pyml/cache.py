"""pyml's cache folder: generated packages of specs outside a project, and Numba's compiled code.

    $PYML_CACHE, default $XDG_CACHE_HOME/pyml (~/.cache/pyml)
      packages/<name>-<key>/   one generated package (`pyml.packages` says how it is keyed)
      numba/                   Numba's cache, unless NUMBA_CACHE_DIR says otherwise

`pyml cache list` and `pyml cache clear` manage it. Everything in it can be made again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pyml.errors import PymlError

PACKAGES = "packages"
NUMBA = "numba"


def cache_dir() -> Path:
    configured = os.environ.get("PYML_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyml"


def writable(folder: Path) -> Path:
    """`folder`, created if needed; a PymlError that says what to do if it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise PymlError(f"cannot write pyml's cache {folder}: {error.strerror}; set PYML_CACHE to "
                        "a writable folder") from None
    return folder


@dataclass(frozen=True)
class Entry:
    path: Path
    name: str  # the spec's name
    key: str
    size: int  # bytes


def entries(cache: Path | None = None) -> list[Entry]:
    """The generated packages in the cache, by name."""
    folder = (cache or cache_dir()) / PACKAGES
    found = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue  # a scratch folder of a generation under way, or set aside
        name, _, key = path.name.rpartition("-")
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        found.append(Entry(path, name, key, size))
    return found


def clear(cache: Path | None = None) -> int:
    """Remove the generated packages and Numba's cache under the cache folder; the number of
    packages removed."""
    root = cache or cache_dir()
    removed = len(entries(root))
    for name in (PACKAGES, NUMBA):
        try:
            shutil.rmtree(root / name)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise PymlError(f"cannot clear {root / name}: {error.strerror}") from None
    return removed
