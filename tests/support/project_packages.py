"""This checkout's generated packages (gen/<name>/, one per spec in specs/), imported as pyml
imports them (`pyml.compile`), under the one module name every process gives them: Numba's cache
pickles the module name of what it compiled, so a file imported under two names breaks the cache
of the other (a ModuleNotFoundError when it loads)."""

from pathlib import Path

import pyml

SPECS = Path(__file__).resolve().parents[2] / "specs"


def project_package(name: str):
    """gen/<name>/, the package of specs/<name>.toml (`pyml check`, run first by `make test`,
    keeps it current; a stale one would be generated into the cache instead)."""
    return pyml.compile(SPECS / f"{name}.toml")
