"""Where a spec's generated package comes from: `pyml.compile`, and the cache behind it.

A spec runs from a project's `gen/NAME/` (the project whose specs/ holds it, or the one around
the working directory) when that package is current for it: generated from this very spec by this
pyml, its files as its manifest records them. Every other spec (a model folder's spec.toml, a file
anywhere, a project's spec not yet generated, a LoRA run's spec with its adapters) is generated
once into the cache (`pyml.cache`) and imported from there: `packages/<name>-<key>/` holds
`specs/<name>.toml`, `gen/<name>/` and `lean/Generated/`, as a project would.

The key digests the spec (canonical: formatting and comments do not count) and everything that
generates code from it: pyml's version, the generator, its templates, the shared modules and the
law statements. So the same spec is generated once per pyml, and a changed pyml never runs a
package it did not generate. An entry is written into a scratch folder and renamed into place, so
two processes asking at once both get a whole one; an entry whose files do not match its
manifest's hashes is set aside and generated again. Nothing is written into pyml's own folders.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path
from types import ModuleType

from pyml import __version__
from pyml.cache import PACKAGES, cache_dir, writable
from pyml.errors import PymlError
from pyml.formats.model_folder import SPEC_FILE
from pyml.project import find_project, spec_project


def generator_inputs() -> dict:
    """What generated code depends on besides its spec, as the manifest records it."""
    from pyml.codegen.manifest import generator_hash, shared_hashes, template_hashes
    from pyml.laws import load_law_index

    return {"generator_version": __version__, "generator_sha256": generator_hash(),
            "templates": template_hashes(), "shared_modules": shared_hashes(),
            "laws": {name: law.sha256 for name, law in load_law_index().items()}}


def spec_digest(spec) -> str:
    from pyml.codegen.manifest import canonical_spec, sha256

    return sha256(canonical_spec(spec))


def package_key(spec, inputs: dict) -> str:
    return hashlib.sha256((spec_digest(spec) + json.dumps(inputs, sort_keys=True)).encode()
                          ).hexdigest()[:16]


def is_current(root: Path, spec, inputs: dict) -> bool:
    """Whether `root/gen/<name>/` was generated from `spec` by this pyml and is whole: its
    manifest names this spec and these generator inputs, and every file it lists has its hash."""
    from pyml.codegen.manifest import sha256

    try:
        manifest = json.loads((root / "gen" / spec.name / "MANIFEST.json").read_text(encoding="utf-8"))
        if manifest["spec"]["sha256"] != spec_digest(spec):
            return False
        if any(manifest[field] != inputs[field] for field in
               ("generator_version", "generator_sha256", "templates", "shared_modules")):
            return False
        if any(inputs["laws"].get(name) != digest for name, digest in manifest["laws"].items()):
            return False
        return all(sha256((root / path).read_text(encoding="utf-8")) == digest
                   for path, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def import_package(package_dir: Path, module_name: str) -> ModuleType:
    """The package in `package_dir`, imported under `module_name` (once per process)."""
    if module_name not in sys.modules:
        found = importlib.util.spec_from_file_location(
            module_name, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)])
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def write_entry(entry: Path, spec, text: str) -> None:
    """Generate `spec` (whose file text is `text`) into a scratch folder beside `entry`, then
    rename it to `entry`. Whoever renames second finds `entry` there and drops its copy."""
    from pyml.codegen.emit import write_generated

    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        spec_path = scratch / "specs" / f"{spec.name}.toml"
        spec_path.parent.mkdir()
        spec_path.write_text(text, encoding="utf-8")
        write_generated(spec, spec_path, scratch)
        scratch.rename(entry)
    except OSError:
        if not entry.exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cached_package(spec, text: str, cache: Path | None = None) -> tuple[Path, ModuleType]:
    """(entry folder, package) of `spec` (its file text `text`) in the cache, generated first if
    it is not there whole."""
    inputs = generator_inputs()
    key = package_key(spec, inputs)
    folder = writable((cache or cache_dir()) / PACKAGES)
    entry = folder / f"{spec.name}-{key}"
    if entry.exists() and not is_current(entry, spec, inputs):
        # set aside with one atomic rename, so that a process reading it meanwhile keeps its files
        aside = Path(tempfile.mkdtemp(prefix=f".corrupt-{entry.name}-", dir=folder))
        try:
            entry.rename(aside / "entry")
        except OSError:
            pass  # another process set it aside first
        shutil.rmtree(aside, ignore_errors=True)
    if not entry.exists():
        try:
            write_entry(entry, spec, text)
        except OSError as error:
            raise PymlError(f"cannot write pyml's cache {folder}: {error.strerror}; set "
                            "PYML_CACHE to a writable folder") from None
    return entry, import_package(entry / "gen" / spec.name, f"pyml_generated_{spec.name}_{key}")


def spec_file(source: Path) -> Path:
    """The spec file `source` names: the file itself, a model folder's spec.toml, or for a
    Hugging Face folder as downloaded (config.json, no spec.toml) the spec made from its config
    (`pyml.formats.hf_import`), generated into the cache, whose entry holds it."""
    source = Path(source)
    if source.is_dir():
        if (source / SPEC_FILE).is_file():
            return source / SPEC_FILE
        if (source / "config.json").is_file():
            return config_spec_file(source)
        raise PymlError(f"{source} holds neither {SPEC_FILE} nor config.json: give a spec file, a "
                        "model folder written by pyml, or a Hugging Face model folder")
    if not source.is_file():
        raise PymlError(f"{source}: no such spec file or model folder")
    return source


def config_spec_file(folder: Path, cache: Path | None = None) -> Path:
    """The spec file of the Hugging Face `folder`'s config.json, in its cache entry (named after
    the folder: the same folder always gets the same entry)."""
    from pyml.formats.hf_import import folder_spec_text
    from pyml.spec import parse_spec

    text = folder_spec_text(folder)
    spec = parse_spec(tomllib.loads(text), f"{Path(folder) / 'config.json'}")
    entry, _ = cached_package(spec, text, cache)
    return entry / "specs" / f"{spec.name}.toml"


def package_for(source: Path) -> ModuleType:
    """The generated package of the spec at `source` (a spec file or a model folder): the
    `gen/<name>/` of the project that holds the spec, or of the project around the working
    directory, if it is current for this very spec; else the cache's, generated once."""
    from pyml.spec import load_spec

    path = spec_file(source)
    spec = load_spec(path)
    inputs = generator_inputs()
    for project in dict.fromkeys(filter(None, (spec_project(path), find_project()))):
        if is_current(project, spec, inputs):
            digest = hashlib.sha256(str(project).encode()).hexdigest()[:8]
            return import_package(project / "gen" / spec.name, f"pyml_project_{digest}_{spec.name}")
    return cached_package(spec, path.read_text(encoding="utf-8"))[1]


def derived_package(data: dict, cache: Path | None = None):
    """(spec, package) of spec data made at run time (a LoRA run's spec, a fuzzer's draw),
    checked as `pyml gen` checks a spec and generated into the cache."""
    from pyml.formats.spec_toml import spec_toml
    from pyml.spec import parse_spec

    text = spec_toml(data, f"{data.get('name')}: made by pyml at run time")
    spec = parse_spec(tomllib.loads(text), f"{data.get('name')} (made at run time)")
    return spec, cached_package(spec, text, cache)[1]
