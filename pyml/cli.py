"""The `pyml` command line.

Every command turns a `PymlError` into one line on stderr and exit status 2; a drift found by
`pyml check` exits 1. Heavy imports happen inside the commands so `pyml --help` stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated

import typer

from pyml.errors import PymlError

app = typer.Typer(
    help="Declare a model once as a typed spec, prove its laws in Lean 4, generate the kernels "
    "that train and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ROOT = Path.cwd()


def user_errors(command: Callable) -> Callable:
    """Report a PymlError as one line and exit 2, instead of a traceback."""

    @wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PymlError as error:
            print(f"error: {error}", file=sys.stderr)
            raise typer.Exit(2) from None

    return run


@app.command()
@user_errors
def gen(
    specs: Annotated[list[Path], typer.Argument(help="Spec files (TOML) to generate code for.")],
    out: Annotated[Path, typer.Option(help="Project root that holds gen/ and lean/Generated/.")] = ROOT,
) -> None:
    """Check each spec's shapes, then write its kernels to gen/<name>/ and its Lean instances to
    lean/Generated/."""
    from pyml.codegen.emit import write_generated
    from pyml.spec import load_spec

    loaded = [load_spec(path) for path in specs]  # every spec is checked before anything is written
    for path, spec in zip(specs, loaded):
        for written in write_generated(spec, path, out):
            print(f"wrote {written}")


@app.command()
@user_errors
def check(
    root: Annotated[Path, typer.Option(help="Project root with specs/, gen/ and lean/.")] = ROOT,
) -> None:
    """Regenerate every spec in specs/ and compare with gen/ and lean/Generated/; exit 1 on drift."""
    from pyml.codegen.drift import find_drift

    drifts = find_drift(root)
    if drifts:
        print(f"pyml check: {len(drifts)} generated file(s) drifted:", file=sys.stderr)
        for drift in drifts:
            print(f"  {drift}", file=sys.stderr)
        print("run `make gen` to regenerate (and never edit gen/ or lean/Generated/ by hand)",
              file=sys.stderr)
        raise typer.Exit(1)
    print("pyml check: everything generated matches specs/, the templates and the Lean laws")


@app.command()
def prove(
    lean_dir: Annotated[Path, typer.Option(help="The Lake package to build.")] = ROOT / "lean",
) -> None:
    """Check the Lean proofs with `lake build` (needs elan or lake on the PATH)."""
    from pyml.prove import prove as run_lake_build

    raise typer.Exit(run_lake_build(lean_dir))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
