"""pyml's stages import each other in one direction only: no import circle, and no stage imports one
above it. Every `import` and `from ... import` of pyml counts, at module level or inside a
function, so a circle cannot hide behind a lazy import.

    errors, outputs, cache, project, thread_pools   (the base)
    spec, formats, weight_formats, laws, exact (what a model is; its files; how weights are stored)
    package                                    (what generated code imports)
    codegen                                    (spec -> generated code that imports package)
    packages                                   (spec -> a generated package, via the cache)
    train, generate                            (running a package)
    serve                                      (the OpenAI API over generate)
    cli, cli_help                              (the command, and how its help reads)

`pyml` itself (its __init__) stands apart: any module may import it (it puts the thread-pool
settings in force first, importing base modules only), and its `pyml.compile` reaches the
packages stage lazily, as the public entry point.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PYML = Path(__file__).resolve().parents[2] / "pyml"
# the stages, lowest first; a module may import its own stage and the ones before it
STAGES = [
    {"errors", "outputs", "cache", "project", "thread_pools"},
    {"spec", "formats", "weight_formats", "laws", "exact"},
    {"package"},
    {"codegen"},
    {"packages", "prove"},
    {"train", "generate"},
    {"serve"},
    {"cli", "cli_help"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PYML.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The pyml modules `path` imports, anywhere in it."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "pyml"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
            if base.split(".")[0] == "pyml":
                found.add(base.rstrip("."))
                found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


MODULES = {module_name(path): path for path in PYML.rglob("*.py") if path != PYML / "__init__.py"}
GRAPH = {name: {target for target in imports(path) if target in MODULES and target != name}
         for name, path in MODULES.items()}


def stage(module: str) -> int:
    return next(index for index, names in enumerate(STAGES) if module.split(".")[1] in names)


def test_every_module_has_a_stage():
    assert all(stage(name) is not None for name in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_stage_above_its_own(module):
    upward = sorted(target for target in GRAPH[module] if stage(target) > stage(module))
    assert not upward, f"{module} (stage {stage(module)}) imports {upward}"


def test_no_import_circle():
    # a package's __init__ that re-exports its submodules is not a circle with them
    def edges(name):
        return {target for target in GRAPH[name] if not (MODULES[target].name == "__init__.py"
                                                         and name.startswith(target + "."))}

    state: dict[str, str] = {}

    def visit(name, path):
        state[name] = "open"
        for target in sorted(edges(name)):
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join([*path, name, target]))
            if target not in state:
                visit(target, [*path, name])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [])


def test_the_walk_sees_lazy_imports():
    """The check would catch a circle hidden in a function, as train <-> distributed once was."""
    assert "pyml.train.run" in GRAPH["pyml.cli"]  # imported inside a command
    assert "pyml.package.base" in GRAPH["pyml.train.distributed"]
