"""pyml's cache folder: generated packages of specs outside a project, and Numba's compiled code.

    $PYML_CACHE, default $XDG_CACHE_HOME/pyml (~/.cache/pyml)
      packages/<name>-<key>/   one generated package (`pyml.packages` says how it is keyed)
      numba/                   Numba's cache, unless NUMBA_CACHE_DIR says otherwise

`pyml cache list` and `pyml cache clear` manage it. Everything in it can be made again.

Numba's cache holds the machine code of the generated packages (tens of MiB per spec, more than
its sources), filed by source folder: `numba_folder` says which is a package's.
"""

from __future__ import annotations

import hashlib
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


def numba_cache_dir() -> Path:
    """Where Numba caches compiled code: NUMBA_CACHE_DIR, which `pyml` sets to the cache's numba/
    unless the user set it."""
    configured = os.environ.get("NUMBA_CACHE_DIR")
    return Path(configured).expanduser() if configured else cache_dir() / NUMBA


def numba_folder(source_dir: Path, numba_dir: Path | None = None) -> Path:
    """The folder of `numba_dir` (default: `numba_cache_dir()`) where Numba caches the functions of
    the source files in `source_dir`: named, as its locator for a NUMBA_CACHE_DIR names it, by the
    folder's name and the SHA-1 of its absolute path (numba/core/caching.py,
    `get_suitable_cache_subpath`)."""
    source = os.path.abspath(source_dir)
    digest = hashlib.sha1(source.encode()).hexdigest()
    return (numba_dir or numba_cache_dir()) / f"{os.path.basename(source)}_{digest}"


def folder_size(folder: Path) -> int:
    """Bytes of the files under `folder` (0 if there is none)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


@dataclass(frozen=True)
class Entry:
    path: Path
    name: str  # the spec's name
    key: str
    size: int  # bytes of the generated files
    compiled: int  # bytes of Numba's compiled code of its kernels


def entries(cache: Path | None = None, numba_dir: Path | None = None) -> list[Entry]:
    """The generated packages in the cache, by name, with the size of their compiled code in
    `numba_dir` (default: `numba_cache_dir()`)."""
    folder = (cache or cache_dir()) / PACKAGES
    found = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue  # a scratch folder of a generation under way, or set aside
        name, _, key = path.name.rpartition("-")
        compiled = folder_size(numba_folder(path / "gen" / name, numba_dir))
        found.append(Entry(path, name, key, folder_size(path), compiled))
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
