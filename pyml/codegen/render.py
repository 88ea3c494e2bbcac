"""Rendering kernel templates into Python source.

Most kinds' kernels are the same for every spec (pyml/package/cpu, cuda) and a kernel module only
re-exports them (`SHARED_KERNELS`); a kind marked `template` (`pyml.codegen.kinds`) has its
kernels rendered per op. A kind's kernel template (`kinds/<kind>_<target>.py.j2`, beside the kind's module) renders to a
block of functions for one layer of that kind, specialised to its dims, all named with the prefix
`p`. A kernel module is a fixed
header (its imports) followed by the blocks of every (kind, dims) a spec needs. A layer with the
kind and dims of an earlier one (a decoder's three RMSNorms) gets no block of its own: its kernel
names are bound to the earlier layer's functions, so each kernel is written and compiled once.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

CODEGEN = Path(__file__).parent
TEMPLATES = CODEGEN / "templates"  # the generated package's modules: model, decode steps
KINDS = CODEGEN / "kinds"  # each kind's kernel templates, beside its module
TARGETS = ("cpu", "cuda")
HEADERS = {
    "cpu": "import math\n\nimport numpy as np\nfrom numba import njit, prange\n\n",
    "cuda": "import math\n\nimport numpy as np\nfrom numba import cuda\n\n",
}
# the modules a kernel module's digest covers (pyml check and the module's first line): the
# shared kernels it re-exports, and what they import
PACKAGE = Path(__file__).resolve().parents[1] / "package"
IMPORTED_BY_SHARED_KERNELS = {"cpu": ["vector_math.py"], "cuda": ["vector_math.py", "cuda_products.py"]}
SHARED_KERNEL_MODULES = {
    target: tuple(sorted(f"pyml/package/{path.relative_to(PACKAGE).as_posix()}"
                         for path in [*(PACKAGE / target).glob("*.py"), PACKAGE / f"kernels_{target}.py",
                                      *(PACKAGE / name for name in IMPORTED_BY_SHARED_KERNELS[target])]))
    for target in ("cpu", "cuda")
}


def header(target: str) -> str:
    """Every shared kernel of the target (pyml/package/<target>/__init__.py lists them), so that a
    generated model calls each kernel as `k.name`."""
    return HEADERS[target] + f"from pyml.package.{target} import *  # noqa: F403\n"


ENVIRONMENT = jinja2.Environment(
    loader=jinja2.FileSystemLoader([TEMPLATES, KINDS]),
    undefined=jinja2.StrictUndefined,  # a template that names a dim the context lacks fails loudly
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def template_name(target: str, kind: str) -> str:
    return f"{kind}_{target}.py.j2"


def template_path(target: str, kind: str) -> Path:
    return KINDS / template_name(target, kind)


def template_files() -> list[Path]:
    """Every template the generator renders, the kinds' and the package modules'."""
    return sorted([*TEMPLATES.glob("*.j2"), *KINDS.glob("*.j2")])


def render_block(target: str, kind: str, context: dict) -> str:
    return ENVIRONMENT.get_template(template_name(target, kind)).render(**context).strip() + "\n"


def shared_block(target: str, kind: str, context: dict, first_prefix: str) -> str:
    """Bindings of layer `context["p"]`'s kernel names to those of `first_prefix`, a layer of the
    same kind and dims: the functions its own block would define, less the helpers that only the
    block's other functions call or launch."""
    prefix, block = context["p"], render_block(target, kind, context)
    names = re.findall(rf"^def {prefix}_(\w+)\(", block, re.MULTILINE)
    helpers = {name for name in names
               if re.search(rf"(?<!def ){prefix}_{name}[(\[]", block)}
    lines = [f"# {prefix} has the kind and dims of {first_prefix}: the same kernels"]
    lines += [f"{prefix}_{name} = {first_prefix}_{name}" for name in names if name not in helpers]
    return "\n".join(lines) + "\n"


def render_kernel_module(target: str, blocks: list[tuple[str, dict]]) -> str:
    """Source of one kernel module: the header, then one rendered block per (kind, context) of a
    kind rendered per op, or bindings to an earlier block of the same kind and dims."""
    from pyml.codegen.kinds import KINDS

    parts, first_prefixes = [header(target)], {}
    for kind, context in blocks:
        if not KINDS[kind].template:
            continue
        dims = (kind, tuple(sorted((key, value) for key, value in context.items() if key != "p")))
        if "p" in context and dims in first_prefixes:
            parts.append(shared_block(target, kind, context, first_prefixes[dims]))
        else:
            first_prefixes.setdefault(dims, context.get("p"))
            parts.append(render_block(target, kind, context))
    return "\n\n".join(parts)
