"""A pyml project: the folder whose specs `pyml gen`, `pyml check` and `pyml prove` work on.

    specs/*.toml          the project's specs
    gen/<name>/           the package `pyml gen` generates for each (never edited by hand)
    lean/lakefile.lean    a Lake package of the generated theorem instances, requiring pyml's laws
    lean/Generated/       the instances, one file per spec

pyml's own checkout is one; `pyml init DIR` makes a new one. A project is found from the working
directory upwards, as git finds a repository. pyml's laws (`LAWS_DIR`) ship inside the pyml
package, so an installed pyml generates and proves anywhere; nothing here writes into them.
"""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

from pyml.errors import PymlError

PACKAGE_DIR = Path(__file__).resolve().parent
LAWS_DIR = PACKAGE_DIR / "lean"  # the Lake package of pyml's laws: PyML/, lakefile, toolchain
TEMPLATE_DIR = PACKAGE_DIR / "project_template"
LAWS_COPY = ".pyml-laws"  # where `pyml prove` puts the laws in a project's lean/ (see sync_laws)
TOOLCHAIN = "lean-toolchain"


def is_project(folder: Path) -> bool:
    return (folder / "specs").is_dir() and (folder / "lean" / "lakefile.lean").is_file()


def find_project(start: Path | None = None) -> Path | None:
    """The nearest folder at or above `start` (default: the working directory) that is a project."""
    folder = Path(start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        if is_project(candidate):
            return candidate
    return None


def project_root(root: Path | None = None) -> Path:
    """`root` if given (it must be a project), else the project around the working directory."""
    if root is not None:
        if not Path(root).is_dir():
            raise PymlError(f"{root}: no such folder")
        if not is_project(Path(root)):
            raise PymlError(f"{root} is not a pyml project (it needs specs/ and lean/lakefile.lean): "
                            "run `pyml init` to make one")
        return Path(root).resolve()
    found = find_project()
    if found is None:
        raise PymlError(f"no pyml project in {Path.cwd()} or above (a folder with specs/ and "
                        "lean/lakefile.lean): run `pyml init DIR` to make one, or pass --root")
    return found


def spec_project(spec_path: Path) -> Path | None:
    """The project whose specs/ holds `spec_path`, if any."""
    folder = Path(spec_path).resolve().parent
    return folder.parent if folder.name == "specs" and is_project(folder.parent) else None


def init_project(folder: Path) -> list[Path]:
    """Write a new project into `folder` (new or empty): an example spec, the Lake package of its
    instances, a .gitignore. Returns the files written."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise PymlError(f"{folder} exists and is not an empty folder: `pyml init` writes a new "
                        "project only into a new or empty folder")
    try:
        written = []
        for source in sorted(TEMPLATE_DIR.rglob("*")):
            if source.is_dir() or "__pycache__" in source.parts:
                continue
            relative = source.relative_to(TEMPLATE_DIR)
            target = folder / (".gitignore" if relative.as_posix() == "gitignore" else relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            written.append(target)
        generated = folder / "lean" / "Generated"
        generated.mkdir(parents=True, exist_ok=True)
        (generated / ".gitkeep").touch()
        shutil.copyfile(LAWS_DIR / TOOLCHAIN, folder / "lean" / TOOLCHAIN)
        written += [generated / ".gitkeep", folder / "lean" / TOOLCHAIN]
    except OSError as error:
        raise PymlError(f"{folder}: cannot write the project: {error.strerror}") from None
    return written


def copy_laws(target: Path) -> Path:
    """Copy the installed pyml's laws into `target` where they differ, keeping Lake's build
    there. A project's lakefile requires such a copy (`lean/.pyml-laws/`): a copy, not a link, so
    that Lake's build of the laws is written there and never into the installed pyml."""
    target = Path(target)
    for source in sorted(LAWS_DIR.rglob("*")):
        relative = source.relative_to(LAWS_DIR)
        if source.is_dir() or "__pycache__" in relative.parts or ".lake" in relative.parts:
            continue
        destination = target / relative
        if not destination.is_file() or not filecmp.cmp(source, destination, shallow=False):
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    for stale in sorted(target.rglob("*.lean"), reverse=True):
        relative = stale.relative_to(target)
        if ".lake" not in relative.parts and not (LAWS_DIR / relative).exists():
            os.remove(stale)  # a law file the installed pyml no longer has
    return target
