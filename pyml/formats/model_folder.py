"""A model folder: the weights and what a reader needs beside them to run the model.

`pyml import-gguf` and `pyml import-hf` write one, every training checkpoint is one, and a Hugging
Face model folder as downloaded is one without spec.toml, whose spec is made from its config.json
(`pyml.formats.hf_import`): `pyml generate --model`, `pyml export-gguf`, `pyml train --init` and
transformers' `from_pretrained` read it. It holds

    the weights, in the form they came (`pyml.formats.stored_tensors` reads them, by memory map):
      source.gguf            an imported GGUF: a symbolic link to the file, or a copy of it
                             (`pyml import-gguf --copy`); quantized as it was
      model.safetensors      Hugging Face names and layout (a checkpoint's, in its training dtype;
                             a downloaded model's, bf16, f16 or f32)
      model.safetensors.index.json and its shards, model-0000N-of-0000M.safetensors, as Hugging
                             Face shards a large model
    spec.toml                the pyml spec whose generated package runs the weights (absent
                             from a downloaded folder)
    config.json              the Hugging Face config (LlamaForCausalLM, Gemma3ForCausalLM, ...)
    generation_config.json   the special token ids
    tokenizer.json, tokenizer_config.json, chat_template.jinja (when the model has one)
    gguf_general.json        the `general.*` metadata of the GGUF it was imported from (name,
                             license, base models, ...), which `pyml export-gguf` carries over

The last six describe the architecture, the tokenizer and the model's origin, which training does
not change: a checkpoint copies them from the folder its run started from (`--init`) and writes its
own weights as model.safetensors (never source.gguf, which would no longer describe them). A model
trained from fresh weights has no such folder (the digits MLP, which has no Hugging Face class
either): its checkpoints hold model.safetensors and spec.toml.
"""

from __future__ import annotations

from pathlib import Path

from pyml.errors import PymlError
from pyml.outputs import atomic_write

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # Hugging Face's sharded weights: names -> shards
SOURCE_GGUF = "source.gguf"  # an imported GGUF: a symbolic link to it, or a copy (--copy)
SPEC_FILE = "spec.toml"
GENERAL_FILE = "gguf_general.json"
# What `pyml import-gguf` writes beside the weights and the spec, in the order it writes them.
DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    GENERAL_FILE,
)


ADAPTER_CONFIG_FILE = "adapter_config.json"  # what marks a LoRA adapter folder (peft's)
STATE_FILE = "state.json"  # what marks a training checkpoint


def is_model_folder(path: Path) -> bool:
    """Whether `path` is an empty folder or a model folder that is not a training checkpoint:
    what `pyml import-gguf` and `pyml merge-lora` may replace without --overwrite."""
    path = Path(path)
    if not path.is_dir():
        return False
    names = {child.name for child in path.iterdir()}
    holds_weights = bool(names & {MODEL_FILE, INDEX_FILE, SOURCE_GGUF})
    return not names or (holds_weights and "config.json" in names and STATE_FILE not in names)


def is_adapter_folder(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file() and not (Path(path) / MODEL_FILE).is_file()


def folder_files(spec_path: Path, init: Path | None) -> dict[str, bytes]:
    """The files a model folder of the spec at `spec_path`, trained from `init`, holds beside its
    weights: the spec, and the description files `init` has when it is a folder."""
    files = {SPEC_FILE: _read(Path(spec_path))}
    if init is not None and Path(init).is_dir():
        for name in DESCRIPTION_FILES:
            if (Path(init) / name).is_file():
                files[name] = _read(Path(init) / name)
    return files


def write_model_folder(folder: Path, model, files: dict[str, bytes]) -> None:
    """Write `model`'s weights (a generated package's Model) and `files` (name -> content) into
    `folder`, each file atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.to_safetensors(folder / MODEL_FILE)
    for name, content in files.items():
        atomic_write(folder / name, lambda handle, content=content: handle.write(content))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None
