"""Importing a llama, qwen2, qwen3, phi3 or gemma3 GGUF as a Hugging Face model folder with its pyml spec.

`import_gguf` writes source.gguf, the weights as the GGUF stores them: a symbolic link to the GGUF
(its absolute path: no second copy of a file of gigabytes), or with `copy` a copy of it, for a
folder that must outlive the GGUF being moved. Every command reads the weights from it by memory
map (`pyml.formats.stored_tensors`); none is dequantised here. Beside it: config.json (the Hugging
Face config of the architecture), generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja (when the file has one), spec.toml (the pyml spec of the model) and
gguf_general.json (the file's `general.*` metadata: its name, license, base models, ..., which
`pyml export-gguf` writes back). A training checkpoint, whose weights are its own, holds
model.safetensors instead. Everything is validated before anything is written, so a bad file
fails with one PymlError line and leaves no half-written folder behind.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import Llama, architecture_of
from pyml.formats.gguf_read import GGUFFile, read_gguf
from pyml.formats.model_folder import GENERAL_FILE, SOURCE_GGUF, SPEC_FILE, is_model_folder
from pyml.weight_formats import dequantize
from pyml.formats.spec_toml import spec_toml
from pyml.formats.tokenizer import (
    build_tokenizer,
    chat_template,
    special_token_id,
    tokenizer_config,
)
from pyml.outputs import check_destination, os_error, written_folder

# general.* keys that describe the file rather than the model: an export writes its own
FILE_KEYS = ("general.architecture", "general.alignment", "general.file_type",
             "general.quantization_version")


def import_gguf(gguf_path: Path, out_dir: Path, progress: bool = True, name: str | None = None,
                overwrite: bool = False, copy: bool = False) -> Path:
    """Write the Hugging Face model folder for the GGUF at `gguf_path` into `out_dir`, its
    source.gguf a symbolic link to the GGUF or, with `copy`, a copy of it; its spec is called
    `name` (default: after the folder). An existing `out_dir` is replaced whole when it is an
    empty or a model folder, otherwise only with `overwrite` (`pyml.outputs`)."""
    out_dir = check_destination(Path(out_dir), "a model folder", is_model_folder, overwrite)
    gguf = read_gguf(gguf_path)
    source = Path(gguf_path).resolve()
    if source.is_relative_to(out_dir.resolve()):
        raise PymlError(f"{gguf_path} is inside --out {out_dir}, which the import replaces: "
                        "write the model folder somewhere else")
    architecture = architecture_of(gguf)
    tied = check_tensors(gguf, architecture)
    tokenizer = build_tokenizer(gguf)

    config = architecture.hf_config(tied) | _generation_config(gguf)
    spec = architecture.spec(name or spec_name(out_dir), tied)
    files = {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(_generation_config(gguf)),
        "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config(gguf)),
        SPEC_FILE: spec_toml(spec, _spec_comment(gguf)).encode("utf-8"),
    }
    template = chat_template(gguf)
    if template is not None:
        files["chat_template.jinja"] = template.encode("utf-8")
    files[GENERAL_FILE] = _json_bytes(general_metadata(gguf))

    with tqdm(total=1 + len(files), disable=not progress, unit="file") as bar:
        try:
            with written_folder(out_dir) as folder:
                if copy:
                    bar.set_description(f"copying the GGUF into {SOURCE_GGUF}")
                    shutil.copyfile(source, folder / SOURCE_GGUF)
                else:
                    bar.set_description(f"linking {SOURCE_GGUF} to {source}")
                    (folder / SOURCE_GGUF).symlink_to(source)
                bar.update()
                for file_name, content in files.items():
                    bar.set_description(f"writing {file_name}")
                    (folder / file_name).write_bytes(content)
                    bar.update()
        except OSError as error:
            raise PymlError(f"{out_dir}: cannot write the model: {os_error(error)}") from None
    return out_dir


def load_gguf_tensors(gguf_path: Path) -> dict[str, np.ndarray]:
    """The GGUF's weights as float32 arrays under Hugging Face names, in Hugging Face layout."""
    gguf = read_gguf(gguf_path)
    architecture = architecture_of(gguf)
    check_tensors(gguf, architecture)
    return _decode_tensors(gguf, architecture)


def spec_name(out_dir: Path) -> str:
    """The spec's name, from the folder's: lower case, `_` for anything not a letter or digit
    (models/gemma3-270m -> gemma3_270m), as a spec name must be an identifier."""
    name = re.sub(r"[^a-z0-9_]", "_", Path(out_dir).resolve().name.lower())
    return name if re.match(r"[a-z_]", name) else f"model_{name}"


def check_tensors(gguf: GGUFFile, architecture: Llama) -> bool:
    """Check the tensor names and shapes against the dims; returns whether the head is tied."""
    dims, kind = architecture.dims, architecture.name
    # Checked first so that a corrupt block count cannot make us list billions of names.
    if dims.n_layers * len(architecture.block_names) > len(gguf.tensors):
        raise PymlError(
            f"{gguf.path}: {kind}.block_count is {dims.n_layers}, but the file holds "
            f"only {len(gguf.tensors)} tensors"
        )
    tied = "output.weight" not in gguf.tensors
    expected = architecture.expected_shapes(tied)
    missing = [name for name in expected if name not in gguf.tensors]
    if missing:
        raise PymlError(f"{gguf.path}: missing tensors {_first_few(missing)} of a {kind} model")
    unexpected = [name for name in gguf.tensors if name not in expected]
    if unexpected:
        raise PymlError(
            f"{gguf.path}: tensors {_first_few(unexpected)} are not part of a {kind} "
            f"model with {dims.n_layers} layers"
        )
    for name, tensor in gguf.tensors.items():
        if tensor.shape != expected[name]:
            raise PymlError(
                f"{gguf.path}: tensor {name!r}: expected shape {expected[name]}, observed "
                f"{tensor.shape} (metadata: {architecture.describe_dims()})"
            )
    return tied


def general_metadata(gguf: GGUFFile) -> dict[str, object]:
    """The file's `general.*` metadata about the model (name, license, base models, tags, ...),
    arrays as lists."""
    return {key: value.tolist() if isinstance(value, np.ndarray) else value
            for key, value in gguf.metadata.items()
            if key.startswith("general.") and key not in FILE_KEYS}


def _generation_config(gguf: GGUFFile) -> dict[str, int]:
    ids = {
        "bos_token_id": special_token_id(gguf, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": special_token_id(gguf, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": special_token_id(gguf, "tokenizer.ggml.padding_token_id"),
    }
    return {name: index for name, index in ids.items() if index is not None}


def _decode_tensors(gguf: GGUFFile, architecture: Llama) -> dict[str, np.ndarray]:
    tensors = {}
    derived = architecture.derived_tensors()  # checked when the dims were read; no weights
    for name, tensor in gguf.tensors.items():
        if name in derived:
            continue
        weight = dequantize(tensor.data, tensor.ggml_type, tensor.shape)
        tensors[architecture.hf_name(name)] = architecture.hf_weight(name, weight)
    return tensors


def _spec_comment(gguf: GGUFFile) -> str:
    model = gguf.metadata.get("general.name")
    named = f"{model}: " if isinstance(model, str) else ""
    return f"{named}written by `pyml import-gguf` from {gguf.path.name}"


def _json_bytes(value: dict[str, object]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _first_few(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
