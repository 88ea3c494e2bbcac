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
from pyml.codegen.render import TEMPLATES



def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def canonical_spec(spec) -> str:
    """The spec as sorted JSON with defaults filled in: formatting and comments do not count."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def template_hashes() -> dict[str, str]:
    return {path.relative_to(TEMPLATES).as_posix(): sha256(path.read_bytes())
            for path in sorted(TEMPLATES.rglob("*.j2"))}


def law_hashes(root: Path, names) -> dict[str, str]:
    from pyml.laws import load_law_index

    index = load_law_index(root / "lean")
    missing = [name for name in names if name not in index]
    if missing:
        from pyml.errors import PymlError

        raise PymlError(f"the kernels rely on Lean law(s) {', '.join(missing)}, which "
                        f"{root / 'lean'} does not state")
    return {name: index[name].sha256 for name in names}


def manifest(spec, plan, root: Path, files: dict[str, str]) -> dict:
    return {
        "generator_version": __version__,
        "spec": {"name": spec.name, "sha256": sha256(canonical_spec(spec))},
        "templates": template_hashes(),
        "laws": law_hashes(root, plan.laws),
        "files": {path: sha256(text) for path, text in sorted(files.items())},
    }
