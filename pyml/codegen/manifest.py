"""MANIFEST.json: what a generated package was made from, by hash.

The drift check regenerates everything and compares bytes; the manifest is what lets it say *why*
a file drifted: the spec changed, a template changed, a Lean law statement changed, or a generated
file was edited by hand.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pyml import __version__
from pyml.codegen import render


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def canonical_spec(spec) -> str:
    """The spec as sorted JSON with defaults filled in: formatting and comments do not count."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def template_hashes() -> dict[str, str]:
    return {f"{path.parent.name}/{path.name}": sha256(path.read_bytes())
            for path in render.template_files()}


PYML_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the pyml package


def shared_hashes() -> dict[str, str]:
    """The hand-written modules generated packages import (everything under pyml/package, and the
    weight formats its kernels read: pyml/weight_formats): a change to one changes what a generated
    package computes without changing its files, so their hashes are part of the manifest."""
    folders = (PYML_ROOT / "pyml" / "package", PYML_ROOT / "pyml" / "weight_formats")
    return {path.relative_to(PYML_ROOT).as_posix(): sha256(path.read_bytes())
            for folder in folders for path in sorted(folder.rglob("*.py"))}


def generator_hash() -> str:
    """One digest of the generator's own modules, the kinds' included: a change to how code is
    generated shows as the reason for drift instead of looking like a hand edit."""
    return sha256("".join(sha256(path.read_bytes())
                          for path in sorted(Path(__file__).parent.rglob("*.py"))))


def shared_hash(paths) -> str:
    """One digest of the shared modules `paths` (a path ending in "/": every module under that
    folder), for a kernel module's first lines."""
    hashes = shared_hashes()
    names = [name for path in paths
             for name in (sorted(n for n in hashes if n.startswith(path)) if path.endswith("/") else [path])]
    return sha256("".join(hashes[name] for name in names))[:16]


def law_hashes(names) -> dict[str, str]:
    from pyml.laws import load_law_index

    index = load_law_index()
    missing = [name for name in names if name not in index]
    if missing:  # a generator that names a law pyml's own laws lack: a bug in pyml
        raise RuntimeError(f"the kernels rely on Lean law(s) {', '.join(missing)}, which pyml's "
                           "laws do not state")
    return {name: index[name].sha256 for name in names}


def manifest(spec, graph, files: dict[str, str]) -> dict:
    from pyml.codegen.lower import relied_on_laws

    return {
        "generator_version": __version__,
        "generator_sha256": generator_hash(),
        "spec": {"name": spec.name, "sha256": sha256(canonical_spec(spec))},
        "templates": template_hashes(),
        "shared_modules": shared_hashes(),
        "laws": law_hashes(relied_on_laws(graph)),
        "files": {path: sha256(text) for path, text in sorted(files.items())},
    }
