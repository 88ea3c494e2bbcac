"""`pyml prove` / `make prove`: check the Lean proofs with `lake build` in `lean/`.

With elan installed, `lake` reads `lean/lean-toolchain` and installs the pinned Lean release
itself on first use. Without a Lean toolchain nothing can be checked: say so on one line and fail.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

NO_TOOLCHAIN = ("pyml prove: no Lean toolchain found (lake not on PATH); install elan from "
                "https://github.com/leanprover/elan to check the proofs")


def find_lake() -> str | None:
    """`lake` on the PATH, else elan's default install location."""
    found = shutil.which("lake")
    if found:
        return found
    elan_lake = Path(os.path.expanduser("~")) / ".elan" / "bin" / "lake"
    return str(elan_lake) if elan_lake.is_file() and os.access(elan_lake, os.X_OK) else None


def prove(lean_dir: Path) -> int:
    """Run `lake build` in `lean_dir`, its output streamed through; return its exit status."""
    lake = find_lake()
    if lake is None:
        print(NO_TOOLCHAIN, file=sys.stderr)
        return 1
    return subprocess.run([lake, "build"], cwd=lean_dir).returncode
