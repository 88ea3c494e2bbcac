"""The index of the Lean laws, read from the Lean sources (never typed twice).

A law is a `theorem` under `pyml/lean/PyML/` preceded by a doc comment that begins with `law:`.
Its statement is the text between the theorem's name and the first `:=` (binders and type), or
its first match alternative `|` for a theorem proved by pattern matching, whitespace-normalised;
the generator records the statement's SHA-256 in each manifest, so a law that changes under
generated code is caught as drift.

`python -m pyml.laws [LEAN_DIR]` prints the index as JSON.
"""

import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pyml import project

# The statement ends at the first `:=`, or, for a theorem proved by pattern matching, at its first
# match alternative (a line that starts with `|`).
_LAW = re.compile(r"/--\s*law:(?P<description>.*?)-/\s*theorem\s+(?P<name>[^\s:({\[]+)"
                  r"(?P<statement>.*?)(?::=|\n\s*\|)", re.DOTALL)


@dataclass(frozen=True)
class Law:
    name: str
    statement: str
    description: str
    source_file: str
    sha256: str


def _normalise(text: str) -> str:
    return " ".join(text.split())


def load_law_index(lean_dir: Path | None = None) -> dict[str, Law]:
    """Every law under `lean_dir/PyML` (default: pyml's laws, `pyml.project.LAWS_DIR`), by name."""
    lean_dir = Path(lean_dir or project.LAWS_DIR)
    index: dict[str, Law] = {}
    for path in sorted((lean_dir / "PyML").rglob("*.lean")):
        for match in _LAW.finditer(path.read_text(encoding="utf-8")):
            statement = _normalise(match["statement"])
            law = Law(name=match["name"], statement=statement,
                      description=_normalise(match["description"]),
                      source_file=path.relative_to(lean_dir).as_posix(),
                      sha256=hashlib.sha256(statement.encode("utf-8")).hexdigest())
            if law.name in index:
                raise ValueError(f"law {law.name} is stated twice under {lean_dir / 'PyML'}")
            index[law.name] = law
    return index


def law_index_json(lean_dir: Path | None = None) -> str:
    return json.dumps({name: asdict(law) for name, law in sorted(load_law_index(lean_dir).items())},
                      indent=2, ensure_ascii=False)


if __name__ == "__main__":
    print(law_index_json(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
