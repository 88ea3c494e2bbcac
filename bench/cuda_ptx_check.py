"""Every CUDA kernel the CUDA case files launch, compiled to PTX for a Hopper GPU (sm_90) by NVIDIA's
numba-cuda and NVVM, on a machine without a GPU. Numba's simulator runs each kernel as Python and
types nothing, so a kernel that NVVM cannot compile would otherwise first fail on a lent GPU's
minutes (docs/gpu.md).

Two steps, in two environments:

    .venv/bin/python bench/cuda_ptx_check.py record launches.json [case files]
        runs the CUDA case files (default: all of tests/cuda/*_cases.py) under the simulator, in
        this process, and writes each distinct launch: the kernel (its file, line, name and the
        values it closes over) and the Numba types of its arguments;
    PYTHON bench/cuda_ptx_check.py compile launches.json
        where PYTHON has numba-cuda with NVVM (`pip install "numba-cuda[cu13]"`, and numpy < 2.5
        for numba-cuda 0.30): imports each kernel's module with the real CUDA target and compiles
        the kernel for those argument types with `numba.cuda.compile_ptx` (no GPU needed); one line
        per kernel, and the exit status is the number that failed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE_FILES = ("cuda_sim_cases.py", "conformance_cuda_cases.py", "generated_cuda_sim_cases.py",
              "quantized_decode_cuda_cases.py", "fuzz_cuda_cases.py")


def closure_values(fn) -> list[str]:
    return [repr(cell.cell_contents) for cell in fn.__closure__ or ()]


def argument_type(value) -> list:
    """A launch argument as ["array", dtype, ndim, layout] or ["scalar", numba type name]."""
    import numba

    array = getattr(value, "_ary", value)  # the simulator's device arrays hold a numpy array
    numba_type = numba.typeof(array)
    if isinstance(numba_type, numba.types.Array):
        return ["array", str(numba_type.dtype), numba_type.ndim, numba_type.layout]
    return ["scalar", str(numba_type)]


def record(out: Path, case_files: list[str]) -> int:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.environ["PYML_CUDA_TARGET"] = "simulator"
    sys.path.insert(0, str(ROOT))
    import pytest
    from numba.cuda.simulator import kernel

    launches = {}
    launch = kernel.FakeCUDAKernel.__call__

    def recording_launch(self, *args):
        if not self._device:
            fn = self.fn
            entry = {"module": fn.__module__, "file": fn.__code__.co_filename,
                     "line": fn.__code__.co_firstlineno, "name": fn.__qualname__,
                     "closure": closure_values(fn), "args": [argument_type(a) for a in args]}
            launches[json.dumps(entry, sort_keys=True)] = entry
        return launch(self, *args)

    kernel.FakeCUDAKernel.__call__ = recording_launch
    status = pytest.main(["-q", "-p", "no:cacheprovider", *(str(ROOT / "tests" / "cuda" / name) for name in case_files)])
    out.write_text(json.dumps(list(launches.values()), indent=1) + "\n")
    print(f"{len(launches)} distinct launches written to {out}")
    return int(status)


def load_module(name: str, file: str):
    """The module `name` defined in `file`: imported by name where it can be (pyml's own), else
    from its file, a generated package's modules with their package around them."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    path = Path(file)
    if "." in name and (path.parent / "__init__.py").exists():
        top = name.split(".")[0]
        if top not in sys.modules:
            spec = importlib.util.spec_from_file_location(top, path.parent / "__init__.py",
                                                          submodule_search_locations=[str(path.parent)])
            package = importlib.util.module_from_spec(spec)
            sys.modules[top] = package
            spec.loader.exec_module(package)
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dispatchers(value, depth: int = 0):
    """The @cuda.jit dispatchers a module's globals hold, directly or in dicts, lists and tuples."""
    if hasattr(value, "py_func"):
        yield value
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from dispatchers(item, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from dispatchers(item, depth + 1)


def kernel_of(entry: dict):
    """The dispatcher of a recorded launch: among the module's globals, or else, for a kernel a
    factory makes on demand (`linear_row_kernel(dtype)`, cached), the factory's result for the
    numpy types the recorded kernel closes over."""
    import numpy as np

    def recorded(dispatcher) -> bool:
        fn = dispatcher.py_func
        return (fn.__code__.co_filename, fn.__code__.co_firstlineno, fn.__qualname__) == \
            (entry["file"], entry["line"], entry["name"]) and closure_values(fn) == entry["closure"]

    module = load_module(entry["module"], entry["file"])
    for dispatcher in dispatchers(vars(module)):
        if recorded(dispatcher):
            return dispatcher
    factory = getattr(module, entry["name"].split(".<locals>.")[0], None)
    types = [getattr(np, value.removeprefix("<class 'numpy.").removesuffix("'>"), None)
             for value in entry["closure"] if value.startswith("<class 'numpy.")]
    if ".<locals>." in entry["name"] and callable(factory) and types and None not in types:
        for dispatcher in dispatchers(factory(*types)):
            if recorded(dispatcher):
                return dispatcher
    raise LookupError(f"no dispatcher of {entry['name']} ({entry['file']}:{entry['line']}) in {entry['module']}")


def numba_type(argument: list):
    from numba import types

    if argument[0] == "array":
        _, dtype, ndim, layout = argument
        return types.Array(getattr(types, dtype), ndim, layout)
    return getattr(types, argument[1])


def compile_all(launches_file: Path) -> int:
    sys.path.insert(0, str(ROOT))
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    from numba import cuda
    from numba.cuda import dispatcher as cuda_dispatcher

    class Hopper:
        compute_capability = (9, 0)

    # a kernel's device functions compile for the current device's capability, which numba-cuda
    # asks the driver for: with no driver here, they are told sm_90, as the kernels are
    cuda_dispatcher.get_current_device = lambda: Hopper

    failed = 0
    launches = json.loads(launches_file.read_text())
    for entry in launches:
        where = f"{entry['name']}({', '.join(map(str, (numba_type(a) for a in entry['args'])))}) " \
                f"[{Path(entry['file']).name}:{entry['line']}]"
        try:
            kernel = kernel_of(entry)
            cuda.compile_ptx(kernel.py_func, tuple(numba_type(a) for a in entry["args"]), cc=(9, 0))
            print(f"ok      {where}")
        except Exception as error:  # noqa: BLE001  every failure is reported, one line each
            failed += 1
            print(f"FAILED  {where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    print(f"{len(launches) - failed} of {len(launches)} launches compiled to PTX for sm_90, {failed} failed")
    return failed


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "compile"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "record":
        raise SystemExit(record(Path(sys.argv[2]), sys.argv[3:] or list(CASE_FILES)))
    raise SystemExit(min(compile_all(Path(sys.argv[2])), 125))


if __name__ == "__main__":
    main()
