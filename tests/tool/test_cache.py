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


def test_a_shared_kernels_entry_is_stamped_with_every_module_of_the_package(tmp_path, monkeypatch):
    """Numba stamps a cached function with its own source file alone, but `linear_stored`'s machine
    code holds quantized_dot's intrinsics and the formats' row loops: pyml/package's entries carry a
    digest of the whole package and of pyml/weight_formats, which changes with any of their files,
    so an edit there cannot leave a stale kernel."""
    import shutil

    from numba.core.caching import FunctionCache

    from pyml.package import numba_cache
    from pyml.package.decode_cpu import linear_stored

    stamp = FunctionCache(linear_stored.py_func)._impl.locator.get_source_stamp()
    assert stamp[1] == numba_cache.package_sources_digest()
    (tmp_path / "outside.py").write_text("def f():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import outside
    finally:
        sys.path.remove(str(tmp_path))
    outside_stamp = FunctionCache(outside.f)._impl.locator.get_source_stamp()
    digest = numba_cache.package_sources_digest()
    assert not (isinstance(outside_stamp, tuple) and outside_stamp[-1] == digest)  # Numba's own elsewhere

    for name in ("PACKAGE_DIR", "WEIGHT_FORMATS_DIR"):
        folder = getattr(numba_cache, name)
        shutil.copytree(folder, tmp_path / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
        monkeypatch.setattr(numba_cache, name, tmp_path / folder.name)
    digests = []
    # the formats' row loops are compiled into the package's kernels too
    for edit in (None, "package/quantized_dot.py", "package/cpu/rope.py", "weight_formats/q4_k.py"):
        if edit is not None:
            (tmp_path / edit).write_text((tmp_path / edit).read_text() + "\n# edited\n")
        numba_cache.package_sources_digest.cache_clear()
        digests.append(numba_cache.package_sources_digest())
    numba_cache.package_sources_digest.cache_clear()
    assert len(set(digests)) == 4
