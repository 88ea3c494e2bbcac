"""A first use that compiles says so on stderr (pyml/package/compile_notice.py): once, as one line,
when Numba's cache holds nothing of the package's kernels; nothing once it does; on a terminal, the
seconds so far, cleared when the compile ends."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = textwrap.dedent("""
    import pyml.package  # what every generated package imports first
    from numba import njit

    @njit(cache=True)
    def twice(x):
        return 2 * x

    @njit(cache=True)
    def thrice(x):
        return 3 * x
""")
CALL = "import kernels_cpu as k; k.twice(1); k.thrice(1)"


def fake_package(root: Path, manifest: bool = True) -> Path:
    """A folder as a generated package's (gen/tiny/, a MANIFEST.json beside its kernels)."""
    package = root / "gen" / "tiny"
    package.mkdir(parents=True)
    (package / "kernels_cpu.py").write_text(KERNELS)
    if manifest:
        (package / "MANIFEST.json").write_text("{}")
    return package


def run(package: Path, numba: Path, call: str = CALL, **streams) -> subprocess.CompletedProcess:
    env = os.environ | {"NUMBA_CACHE_DIR": str(numba),
                        "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", call], env=env, timeout=300, check=True, **streams)


def test_the_first_use_says_so_once_and_later_ones_say_nothing(tmp_path):
    package = fake_package(tmp_path)
    first = run(package, tmp_path / "numba", capture_output=True, text=True)
    assert first.stderr == "compiling kernels for tiny (first use)...\n"
    # cached now: loaded, or compiled for new argument types (float64 after int64), silently
    again = run(package, tmp_path / "numba", CALL + "; k.twice(1.5)", capture_output=True, text=True)
    assert again.stderr == ""


def test_kernels_outside_a_generated_package_are_pyml_s(tmp_path):
    package = fake_package(tmp_path, manifest=False)
    first = run(package, tmp_path / "numba", capture_output=True, text=True)
    assert first.stderr == "compiling pyml's kernels (first use)...\n"


def test_on_a_terminal_the_line_counts_seconds_and_is_cleared(tmp_path):
    package = fake_package(tmp_path)
    reading, terminal = os.openpty()
    try:
        run(package, tmp_path / "numba", stderr=terminal, stdout=subprocess.DEVNULL)
        os.close(terminal)
        written = b""
        while True:
            try:
                chunk = os.read(reading, 4096)
            except OSError:  # the terminal's other end closed: all read
                break
            if not chunk:
                break
            written += chunk
    finally:
        os.close(reading)
    text = written.decode()
    assert "\rcompiling kernels for tiny (first use)... 0 s" in text
    assert text.endswith("\r\x1b[K")  # the command's own output would start on a clear line
