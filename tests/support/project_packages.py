"""This checkout's generated packages (gen/<name>/, one per spec in specs/), imported as pyml
imports them (`pyml.compile`), so the tests and the `pyml` commands they run share one Numba cache
entry per kernel (Numba keys its cache by module name too: `pyml.package.numba_cache`)."""

from pathlib import Path

import pyml

SPECS = Path(__file__).resolve().parents[2] / "specs"


def project_package(name: str):
    """gen/<name>/, the package of specs/<name>.toml (`pyml check`, run first by `make test`,
    keeps it current; a stale one would be generated into the cache instead)."""
    return pyml.compile(SPECS / f"{name}.toml")
