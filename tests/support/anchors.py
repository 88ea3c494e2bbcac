"""The anchors: what the suite checks pyml against or runs it with that pip's test extra does not
bring: llama.cpp (llama-cpp-python, built from source), Debian's chromium and chromedriver,
mpiexec, curl, git, the shipped models. `make test` installs them and sets PYML_REQUIRE_ANCHORS=1;
there a missing one fails the tests that need it, since a skip lets a run pass that never made
those checks (the 57 llama.cpp checks skipped on every fresh clone until issue 47). Run any other
way (pytest directly, a machine that cannot build llama.cpp), they are skipped with the reason."""

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("PYML_REQUIRE_ANCHORS") == "1"


def missing(reason: str) -> NoReturn:
    """Fail the calling test under `make test`, skip it elsewhere; `reason` is one line saying
    what is missing and how to get it."""
    if REQUIRED:
        pytest.fail(f"missing anchor: {reason}", pytrace=False)
    pytest.skip(reason)


def module(name: str, install: str) -> ModuleType:
    """The module `name`, which `install` (a command, or the make target) provides."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        reason = f"cannot import {name} ({error}): {install}"
    missing(reason)  # outside the except block, so that a failure shows the reason alone


def program(name: str, install: str) -> str:
    """The path of the program `name` on PATH, which `install` provides."""
    path = shutil.which(name)
    if path is None:
        missing(f"no {name} on PATH: {install}")
    return path
