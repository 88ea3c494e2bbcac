"""`make mutants`: plant each bug of mutants/catalogue.toml, one at a time, and check a test fails.

The tree (git's tracked and untracked, not ignored, files) is copied to a scratch folder at a fixed
path, and the fast tests (`-m "not slow"`) are run there once unmutated: they must pass. Then, for
each entry: its `find` text is replaced in the scratch copy, the generated packages are
regenerated (`pyml gen specs/*.toml`) when the file is one the generator reads, and pytest runs
with `-x`, the entry's own `tests` first (then the test that killed it last time), then, if those
pass, the whole fast suite with the files most likely to fail first. The first failure kills the
mutant; a pytest or `pyml gen` run that crashes or outlives its time limit kills it too. Then every
changed file is put back, content and modification time.

Keeping caches valid between mutants, so that each one compiles only what it changed:
- Files are written only when their content changes, and a restored file gets back its original
  modification time, so Python's bytecode and Numba's cache (both keyed by a source file's path and
  modification time) stay valid for everything a mutant did not touch. Mutant runs write no bytecode.
- Numba's cache for the mutant is a hard-linked copy of the unmutated run's cache, thrown away
  afterwards (Numba replaces cache files, never writes into them, so the original stays intact).
- Numba does not notice that an njit function imported from another file has changed: when a
  changed file defines compiled functions, the cache entries of every module that imports it,
  directly or through other modules, are deleted from the mutant's copy.
- The kernel tests write rendered modules under TMPDIR, named by their content; TMPDIR is the
  scratch folder's, and what a mutant adds there is deleted after it.

Exit status: 0 when every mutant was killed (or is listed as equivalent), 1 when one survived, 2 when
the catalogue is out of date (an entry's text is not found, or found more than once) or the
unmutated tests fail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1]
CATALOGUE = SOURCE / "mutants" / "catalogue.toml"
# fixed per source tree, so that caches survive from one `make mutants` to the next
SCRATCH = Path(tempfile.gettempdir()) / (
    "pyml-mutants-" + hashlib.sha256(str(SOURCE).encode()).hexdigest()[:12])
TREE, BASE_CACHE, MUTANT_CACHE, TMP = (SCRATCH / name for name in ("tree", "numba", "numba-mutant", "tmp"))
KILLERS = SCRATCH / "killers.json"  # the test that killed each mutant last time, tried first next time
BASELINE_TIMES = SCRATCH / "baseline.xml"
# a file under these is read by the generator: mutating it means regenerating gen/ and lean/Generated/
GENERATOR_INPUTS = ("pyml/codegen/", "pyml/package/", "pyml/spec/", "specs/", "pyml/lean/")
GENERATED = ("gen", "lean/Generated")
COMPILED = re.compile(r"@(?:numba\.)?(?:njit|jit|cuda\.jit|vectorize|guvectorize|stencil)\b|@overload\b")
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider"]


@dataclass
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    why: str
    tests: list[str] = field(default_factory=list)
    equivalent: str = ""


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # KILLED, SURVIVED, STALE, AMBIGUOUS, EQUIVALENT
    detail: str = ""
    seconds: float = 0.0


def load_catalogue() -> list[Mutant]:
    entries = tomllib.loads(CATALOGUE.read_text(encoding="utf-8"))["mutant"]
    mutants = [Mutant(**entry) for entry in entries]
    ids = [mutant.id for mutant in mutants]
    duplicated = sorted({name for name in ids if ids.count(name) > 1})
    if duplicated:
        sys.exit(f"mutants: duplicate ids in {CATALOGUE}: {', '.join(duplicated)}")
    return mutants


# --- the scratch tree -----------------------------------------------------------------------------

def project_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=SOURCE, capture_output=True, check=True).stdout
    return sorted({name for name in listed.decode().split("\0") if name and (SOURCE / name).is_file()})


def write_if_changed(path: Path, content: bytes) -> bool:
    if path.is_file() and path.read_bytes() == content:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return True


def sync_tree() -> None:
    """Make TREE hold the project's files, rewriting only those whose content differs."""
    files = project_files()
    for name in files:
        write_if_changed(TREE / name, (SOURCE / name).read_bytes())
    listing = SCRATCH / "files.json"
    if listing.exists():
        for name in set(json.loads(listing.read_text())) - set(files):
            (TREE / name).unlink(missing_ok=True)
    listing.write_text(json.dumps(files))


def snapshot(relatives) -> dict[Path, tuple[bytes, int]]:
    """Content and modification time (ns) of the tree's generated files and `relatives`."""
    paths = [path for folder in GENERATED for path in (TREE / folder).rglob("*")
             if path.is_file() and "__pycache__" not in path.parts]
    paths += [TREE / relative for relative in relatives]
    return {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in paths}


def restore(saved: dict[Path, tuple[bytes, int]]) -> list[Path]:
    """Put back every saved file whose content differs (with its old modification time); delete
    generated files that were not there. Returns the paths that had changed."""
    changed = []
    for path, (content, mtime_ns) in saved.items():
        if not path.is_file() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(path)
        if path.stat().st_mtime_ns != mtime_ns:
            os.utime(path, ns=(mtime_ns, mtime_ns))
    for folder in GENERATED:
        for path in (TREE / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path not in saved:
                path.unlink()
                changed.append(path)
    return changed


def regenerate(env: dict) -> subprocess.CompletedProcess:
    """`pyml gen` of every spec, then the old modification time back on each file it rewrote with
    the same content, so caches keyed by modification time stay valid."""
    before = snapshot(())
    specs = sorted(str(path.relative_to(TREE)) for path in (TREE / "specs").glob("*.toml"))
    result = subprocess.run([sys.executable, "-m", "pyml.cli", "gen", *specs], cwd=TREE, env=env,
                            capture_output=True, text=True, timeout=600)
    for path, (content, mtime_ns) in before.items():
        if path.is_file() and path.read_bytes() == content:
            os.utime(path, ns=(mtime_ns, mtime_ns))
    return result


# --- Numba's cache --------------------------------------------------------------------------------

def cache_folder(cache: Path, source: Path) -> Path:
    """Where Numba caches the functions of `source` (numba.core.caching._CacheLocator)."""
    folder = os.path.dirname(os.path.abspath(source))
    return cache / f"{os.path.split(folder)[-1]}_{hashlib.sha1(folder.encode()).hexdigest()}"


def module_stem(path: Path) -> str:
    """The last part of the name a file is imported by: its package's for an __init__.py."""
    return path.parent.name if path.name == "__init__.py" else path.stem


def forget_importers(cache: Path, changed: list[Path]) -> None:
    """Delete the cache entries of every module that imports a changed file defining compiled
    functions, directly or through others (a generated kernel module imports the shared kernels
    through `pyml.package.cpu`): Numba checks only the stamp of the file a function is defined in."""
    compiled = [path for path in changed if path.suffix == ".py" and path.is_file()
                and COMPILED.search(path.read_text(encoding="utf-8", errors="replace"))]
    if not compiled:
        return
    sources = {path: path.read_text(errors="replace") for root in (TREE, TMP) for path in root.rglob("*.py")
               if "__pycache__" not in path.parts}
    reached, frontier = set(compiled), list(compiled)
    while frontier:
        stem = re.escape(module_stem(frontier.pop()))
        imports = re.compile(rf"^\s*(?:from\s+[\w.]*\b{stem}\b|import\s+[\w.]*\b{stem}\b|"
                             rf"from\s+[\w.]+\s+import\s+.*\b{stem}\b)", re.MULTILINE)
        for source, text in sources.items():
            if source not in reached and imports.search(text):
                reached.add(source)
                frontier.append(source)
    for source in reached - set(compiled):
        for entry in cache_folder(cache, source).glob(f"{source.stem}.*"):
            entry.unlink()


def fresh_mutant_cache() -> None:
    shutil.rmtree(MUTANT_CACHE, ignore_errors=True)
    if BASE_CACHE.exists():
        shutil.copytree(BASE_CACHE, MUTANT_CACHE, copy_function=os.link)


# --- running the tests ----------------------------------------------------------------------------

def environment(cache: Path, bytecode: bool) -> dict:
    # PYTHONPATH: a test's subprocess started in another folder (`pyml gen` in a temporary project)
    # would otherwise import pyml from wherever it is installed, not the scratch tree
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), TMPDIR=str(TMP), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(TREE))
    if not bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return output.strip().splitlines()[-1] if output.strip() else "no output"


def run_pytest(targets: list[str], env: dict, timeout: float, extra=()) -> tuple[str, str]:
    """('passed' | 'failed' | 'timeout' | 'unusable', what failed)."""
    try:
        result = subprocess.run([*PYTEST, *extra, *targets], cwd=TREE, env=env, capture_output=True,
                                text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"pytest ran past {timeout:.0f} s"
    if result.returncode == 0:
        return "passed", ""
    if result.returncode in (4, 5):  # usage error, no tests collected: a stale test name
        return "unusable", first_failure(result.stdout + result.stderr)
    if result.returncode < 0:
        return "failed", f"pytest died of signal {-result.returncode}"
    return "failed", first_failure(result.stdout + result.stderr)


def file_times() -> dict[str, float]:
    """Seconds each test file took in the unmutated run (JUnit classnames are `tests.area.test_x`, with
    a class name after it for tests in a class)."""
    times: dict[str, float] = {}
    if BASELINE_TIMES.exists():
        for case in ElementTree.parse(BASELINE_TIMES).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")
            modules = [index for index, part in enumerate(parts) if part.startswith("test_")]
            if modules:
                name = "/".join(parts[: modules[0] + 1]) + ".py"
                times[name] = times.get(name, 0.0) + float(case.get("time", 0))
    return times


# It checks the catalogue against the code, which a planted mutant changes by design: it would
# kill every mutant and say nothing of the suite.
CATALOGUE_TEST = "tests/tool/test_mutant_catalogue.py"


def suite_order(mutant: Mutant, times: dict[str, float]) -> list[str]:
    """Every test file but the catalogue's own, the mutant's first, then the rest fastest first."""
    files = sorted(str(path.relative_to(TREE)) for path in (TREE / "tests").rglob("test_*.py")
                   if str(path.relative_to(TREE)) != CATALOGUE_TEST)
    hinted = [name for name in dict.fromkeys(test.split("::")[0] for test in mutant.tests)
              if name in files]
    rest = sorted((name for name in files if name not in hinted), key=lambda name: times.get(name, 0.0))
    return hinted + rest


# --- one mutant -----------------------------------------------------------------------------------

def try_mutant(mutant: Mutant, killers: dict, times: dict, timeout: float) -> Outcome:
    path = TREE / mutant.file
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    count = text.count(mutant.find)
    if count == 0:
        return Outcome(mutant, "STALE", f"text not found in {mutant.file}")
    if count > 1:
        return Outcome(mutant, "AMBIGUOUS", f"text found {count} times in {mutant.file}")
    if mutant.equivalent:
        return Outcome(mutant, "EQUIVALENT", mutant.equivalent)

    started = time.monotonic()
    saved = snapshot([mutant.file])
    fresh_mutant_cache()
    tmp_before = set(TMP.rglob("*"))
    env = environment(MUTANT_CACHE, bytecode=False)
    try:
        path.write_text(text.replace(mutant.find, mutant.replace), encoding="utf-8")
        if mutant.file.startswith(GENERATOR_INPUTS):
            generated = regenerate(env)
            if generated.returncode != 0:
                return Outcome(mutant, "KILLED", "pyml gen failed: " + first_failure(generated.stderr),
                               time.monotonic() - started)
        changed = [p for p, (content, _) in saved.items() if not p.is_file() or p.read_bytes() != content]
        assert path in changed and mutant.replace in path.read_text(encoding="utf-8")
        forget_importers(MUTANT_CACHE, changed)
        shown = [str(p.relative_to(TREE)) for p in changed if p != path]
        note = f" (regenerated {len(shown)} file(s))" if shown else ""

        # the catalogue's tests are chosen to be quick; the last killer may be any test
        first = list(dict.fromkeys([*mutant.tests, *([killers[mutant.id]] if mutant.id in killers else [])]))
        if first:
            status, failure = run_pytest(first, env, timeout)
            if status in ("failed", "timeout"):
                return Outcome(mutant, "KILLED", failure + note, time.monotonic() - started)
        status, failure = run_pytest(suite_order(mutant, times), env, timeout)
        if status in ("failed", "timeout"):
            return Outcome(mutant, "KILLED", failure + note, time.monotonic() - started)
        if status == "unusable":
            return Outcome(mutant, "AMBIGUOUS", f"pytest could not run: {failure}",
                           time.monotonic() - started)
        return Outcome(mutant, "SURVIVED", "every fast test passed" + note, time.monotonic() - started)
    finally:
        restore(saved)
        for entry in sorted(set(TMP.rglob("*")) - tmp_before, reverse=True):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        shutil.rmtree(MUTANT_CACHE, ignore_errors=True)


# --- the whole run --------------------------------------------------------------------------------

def commit_of_source() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=SOURCE, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=SOURCE, capture_output=True,
                           text=True).stdout.strip()
    return head + (" with uncommitted changes" if dirty else "")


def baseline() -> float:
    """Regenerate and run the fast suite unmutated in the scratch tree; its duration in seconds."""
    env = environment(BASE_CACHE, bytecode=True)
    for folder in (TREE, TMP):  # the tests' own processes, and those they start elsewhere
        imported = subprocess.run([sys.executable, "-c", "import gen, pyml; print(pyml.__file__, gen.__file__)"],
                                  cwd=folder, env=env, capture_output=True, text=True).stdout.split()
        if not imported or not all(Path(path).is_relative_to(TREE) for path in imported):
            sys.exit(f"mutants: python in {folder} imports pyml and gen from {imported}, not {TREE}")
    generated = regenerate(env)
    if generated.returncode != 0:
        sys.exit(f"mutants: `pyml gen` fails on the unmutated tree:\n{generated.stderr}")
    started = time.monotonic()
    status, failure = run_pytest([], env, timeout=3600, extra=[f"--junitxml={BASELINE_TIMES}"])
    if status != "passed":
        print(f"mutants: the unmutated fast tests do not pass ({failure}); fix them first",
              file=sys.stderr)
        sys.exit(2)
    return time.monotonic() - started


def main() -> int:
    # a kill ends the run through the `finally` that puts the mutated files back
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="run only these catalogue entries")
    args = parser.parse_args()
    mutants = load_catalogue()
    unknown = sorted(set(args.ids) - {mutant.id for mutant in mutants})
    if unknown:
        sys.exit(f"mutants: no catalogue entries {', '.join(unknown)}")
    chosen = [mutant for mutant in mutants if not args.ids or mutant.id in args.ids]

    for folder in (TREE, TMP):
        folder.mkdir(parents=True, exist_ok=True)
    started, commit = time.monotonic(), commit_of_source()
    print(f"mutants: {len(chosen)} of {len(mutants)} catalogue entries, source {SOURCE} at {commit}, "
          f"scratch {SCRATCH}", flush=True)
    sync_tree()
    seconds = baseline()
    print(f"unmutated fast tests pass ({seconds:.0f} s)", flush=True)
    timeout = max(3 * seconds, 600)
    killers = json.loads(KILLERS.read_text()) if KILLERS.exists() else {}
    times = file_times()

    outcomes = []
    for mutant in chosen:
        outcome = try_mutant(mutant, killers, times, timeout)
        outcomes.append(outcome)
        if outcome.status == "KILLED" and outcome.detail.startswith(("FAILED ", "ERROR ")):
            killers[mutant.id] = outcome.detail.split(" ", 1)[1].split(" (regenerated")[0]
            KILLERS.write_text(json.dumps(killers, indent=1, sort_keys=True))
        print(f"{outcome.status:10} {mutant.id:45} {outcome.seconds:6.0f} s  {outcome.detail}",
              flush=True)

    counts = {status: sum(o.status == status for o in outcomes)
              for status in ("KILLED", "SURVIVED", "EQUIVALENT", "STALE", "AMBIGUOUS")}
    scored = counts["KILLED"] + counts["SURVIVED"]
    minutes = (time.monotonic() - started) / 60
    print(f"\nmutation score: {counts['KILLED']}/{scored} killed"
          + "".join(f", {count} {status.lower()}" for status, count in counts.items()
                    if count and status not in ("KILLED",))
          + f"; {minutes:.0f} min, {time.strftime('%Y-%m-%d')}, source at {commit}")
    for outcome in outcomes:
        if outcome.status in ("SURVIVED", "STALE", "AMBIGUOUS"):
            print(f"  {outcome.status}: {outcome.mutant.id} ({outcome.mutant.file}): {outcome.detail}")
    if counts["SURVIVED"]:
        return 1
    return 2 if counts["STALE"] or counts["AMBIGUOUS"] else 0


if __name__ == "__main__":
    sys.exit(main())
