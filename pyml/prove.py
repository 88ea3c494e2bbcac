"""`pyml prove` / `make prove`: check the Lean proofs with `lake build`.

In a project: pyml's laws are copied into `lean/.pyml-laws/` (`pyml.project.copy_laws`) and built
there, with their `#print axioms`; then the project's Lake package, whose generated instances
import them. Outside a project: the laws alone, built in a copy under pyml's cache. With elan
installed, `lake` reads `lean-toolchain` and installs the pinned Lean release itself on first use.
Without a Lean toolchain nothing can be checked: say so on one line and fail.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pyml.cache import cache_dir, writable
from pyml.errors import PymlError
from pyml.project import LAWS_COPY, LAWS_DIR, TOOLCHAIN, copy_laws

NO_TOOLCHAIN = ("pyml prove: no Lean toolchain found (lake not on PATH); install elan from "
                "https://github.com/leanprover/elan to check the proofs")


def find_lake() -> str | None:
    """`lake` on the PATH, else elan's default install location."""
    found = shutil.which("lake")
    if found:
        return found
    elan_lake = Path(os.path.expanduser("~")) / ".elan" / "bin" / "lake"
    return str(elan_lake) if elan_lake.is_file() and os.access(elan_lake, os.X_OK) else None


def prove(project: Path | None) -> int:
    """`lake build` of pyml's laws, then of `project`'s instances (if a project is given), their
    output streamed through; the first non-zero exit status, or 0."""
    lake = find_lake()
    if lake is None:
        print(NO_TOOLCHAIN, file=sys.stderr)
        return 1
    if project is None:
        return subprocess.run([lake, "build"], cwd=copy_laws(writable(cache_dir() / "lean-laws"))).returncode
    lean_dir = Path(project) / "lean"
    pinned, needed = ((folder / TOOLCHAIN).read_text().strip() if (folder / TOOLCHAIN).is_file()
                      else "nothing" for folder in (lean_dir, LAWS_DIR))
    if pinned != needed:
        raise PymlError(f"{lean_dir / TOOLCHAIN} pins {pinned}, pyml's laws need {needed}: write "
                        f"{needed} into it")
    laws = copy_laws(lean_dir / LAWS_COPY)
    built = subprocess.run([lake, "build"], cwd=laws).returncode
    return built or subprocess.run([lake, "build"], cwd=lean_dir).returncode
