"""Numba's on-disk cache, keyed by the module name as well as the source file.

Numba files a cached function under its source file and qualified name only, but what it pickles
with the compiled code (the function's environment) names the module that compiled it, and loading
the entry imports that module by name. A generated package is imported under more than one name:
`import gen.smollm2_135m` in a project, `pyml_project_<digest>_smollm2_135m` by the `pyml` command
(any name, as Python allows). Without a key per name, whichever name compiles second loads the
other's entry and fails with `ModuleNotFoundError` (2026-12-05). Each locator Numba tries is
therefore wrapped so that an entry's file name also carries a digest of the module's name: two
names compile and cache separately, and neither ever reads the other's entry. The wrapped locators
also stamp the entries of pyml/package's own kernels with a digest of the whole package
(`package_sources_digest`), since their machine code holds what they call from its other files.

Numba offers no public hook for this (its `NUMBA_CACHE_LOCATOR_CLASSES` setting replaces the
list rather than wrapping it, and is read from the environment); the list of locator classes on
its cache implementation's base class (`CacheImpl`; `_CacheImpl` in older releases) is the one
place every cache (CPU and CUDA) asks. `tests/tool/test_packages.py`
imports one package under two names in separate processes, so a Numba that changes this fails
there rather than in a user's hands.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

PACKAGE_DIR = Path(__file__).resolve().parent
# the weight formats' row loops, which the package's kernels compile into their machine code
WEIGHT_FORMATS_DIR = PACKAGE_DIR.parent / "weight_formats"


def module_digest(module_name: str) -> str:
    return hashlib.sha256(module_name.encode()).hexdigest()[:12]


def keyed_by_module(locator_class: type) -> type:
    """`locator_class`, its entries' disambiguator (part of every cache file's name) extended by
    the digest of the cached function's module name."""

    class ModuleKeyedLocator(locator_class):
        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            self._module_digest = module_digest(py_func.__module__ or "")

        def get_disambiguator(self):
            return f"{super().get_disambiguator()}-{self._module_digest}"

        def get_source_stamp(self):
            stamp = super().get_source_stamp()
            source = getattr(self, "_py_file", None)
            if source is not None and PACKAGE_DIR in Path(source).resolve().parents:
                return stamp, package_sources_digest()
            return stamp

    ModuleKeyedLocator.__name__ = ModuleKeyedLocator.__qualname__ = f"ModuleKeyed{locator_class.__name__}"
    ModuleKeyedLocator.keyed_by_module = True
    return ModuleKeyedLocator


@functools.cache
def package_sources_digest() -> str:
    """One digest of every module under pyml/package and pyml/weight_formats, part of the stamp of
    each cached function declared in pyml/package. Numba files an entry under its own source
    file's stamp only, but a shared kernel's machine code holds what it calls from other files
    (quantized_dot's intrinsics and the formats' row loops in decode_cpu's linear maps,
    vector_math's loops in the norms): with this digest, a change to any of them makes those
    entries stale instead of silently reused."""
    digest = hashlib.sha256()
    for folder in (PACKAGE_DIR, WEIGHT_FORMATS_DIR):
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.relative_to(folder.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key_cache_by_module() -> None:
    """Wrap Numba's locators once per process (before any cached function is declared)."""
    cache_impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    locators = cache_impl._locator_classes
    if not all(getattr(locator, "keyed_by_module", False) for locator in locators):
        cache_impl._locator_classes = [
            locator if getattr(locator, "keyed_by_module", False) else keyed_by_module(locator)
            for locator in locators]


key_cache_by_module()
