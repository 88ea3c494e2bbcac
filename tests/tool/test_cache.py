"""`pyml cache list` counts Numba's compiled code, found where Numba itself files it."""

import os
import subprocess
import sys
import textwrap

from pyml.cache import numba_folder


def test_numba_folder_is_where_numba_caches_a_folders_functions(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "kernels.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2 * x
    """))
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(source)}
    subprocess.run([sys.executable, "-c", "import kernels; assert kernels.twice(3) == 6"], env=env,
                   check=True, timeout=300)
    assert list(numba_folder(source, tmp_path / "numba").glob("kernels.twice-*.nbi"))


def test_cache_list_counts_each_packages_compiled_code_and_all_of_numbas(tmp_path):
    package = tmp_path / "cache" / "packages" / "tiny-0123456789abcdef" / "gen" / "tiny"
    package.mkdir(parents=True)
    (package / "kernels_cpu.py").write_text("# generated\n")
    compiled = numba_folder(package, tmp_path / "numba")
    compiled.mkdir(parents=True)
    (compiled / "kernels_cpu.add-7.py311.1.nbc").write_bytes(bytes(2 * 2**20))
    shared = numba_folder(tmp_path / "pyml" / "package" / "cpu", tmp_path / "numba")
    shared.mkdir(parents=True)
    (shared / "linear.forward-9.py311.1.nbc").write_bytes(bytes(2**20))
    env = os.environ | {"PYML_CACHE": str(tmp_path / "cache"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    listed = subprocess.run([sys.executable, "-m", "pyml.cli", "cache", "list"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    entry, total = listed.stdout.splitlines()
    assert entry.startswith("tiny  0123456789abcdef  0.0 MiB, compiled 2.0 MiB  ")
    assert total == (f"1 package(s) in {tmp_path / 'cache'}; Numba's compiled code: 3.0 MiB in "
                     f"{tmp_path / 'numba'}")
