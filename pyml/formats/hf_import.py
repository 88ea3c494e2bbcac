"""A Hugging Face model folder as downloaded: its pyml spec from config.json, and `pyml import-hf`.

A folder from the Hub holds config.json, the tokenizer (tokenizer.json, tokenizer_config.json,
perhaps chat_template.jinja), generation_config.json and the weights, model.safetensors or the
shards model-0000N-of-0000M.safetensors with their index, in bf16, f16 or f32. It has no
spec.toml: the spec comes from config.json. We read the same dimensions from it that an import of
the model's GGUF reads from the GGUF's metadata (`gguf_architectures`' Dims) and let the same
architecture build the spec, so a model has one spec whichever form it came in. What pyml cannot
run (another architecture, a RoPE scaling or window it does not take, biases where its block has
none) is refused in one line that names the field.

config.json is read as transformers reads it (`hf_config.config_as_read`: transformers 5's
`rope_parameters`, older files' `type`, each class's defaults). Commands use such a folder as it
is (`pyml.packages.spec_file` generates its spec into the cache); `import_hf` writes a model folder
of it with spec.toml, its weights links to the downloaded files (or copies), no dtype changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tqdm import tqdm

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import (
    Gemma3,
    Gemma3Dims,
    Llama,
    LlamaDims,
    Phi3,
    Phi3Dims,
    Qwen2,
    Qwen3,
)
from pyml.formats.gguf_import import spec_name
from pyml.formats.hf_config import config_as_read
from pyml.formats.model_folder import INDEX_FILE, MODEL_FILE, SPEC_FILE, is_model_folder
from pyml.formats.spec_toml import spec_toml
from pyml.formats.stored_tensors import StoredFolder
from pyml.outputs import check_destination, os_error, written_folder

CONFIG_FILE = "config.json"
# config.json's `architectures` entry -> (its model_type, the architecture whose spec runs it);
# Mistral's model is Llama's, and llama.cpp converts it as llama.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", Llama),
    "MistralForCausalLM": ("mistral", Llama),
    "Qwen2ForCausalLM": ("qwen2", Qwen2),
    "Qwen3ForCausalLM": ("qwen3", Qwen3),
    "Phi3ForCausalLM": ("phi3", Phi3),
    "Gemma3ForCausalLM": ("gemma3_text", Gemma3),
}
# The RoPE scalings each architecture takes (rope_scaling's rope_type), as its GGUF import does.
ROPE_SCALINGS = {Llama: ("linear", "llama3"), Qwen2: ("linear",), Qwen3: ("linear",),
                 Phi3: ("longrope",), Gemma3: ()}
# The parameters of each RoPE scaling the spec holds; any other key of rope_scaling is refused.
SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
}
# Keys of rope_scaling that say nothing the spec needs: transformers' own bookkeeping.
SCALING_NOTES = ("rope_type", "rope_theta")
# What the folder holds beside the weights that `import_hf` carries over as it is.
DESCRIPTION_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ConfigFields:
    """Typed, checked reads of config.json as transformers reads it (`config_as_read`)."""

    def __init__(self, config: dict, path: Path):
        self.config, self.path = config_as_read(config), path

    def fail(self, message: str) -> PymlError:
        return PymlError(f"{self.path}: {message}")

    def integer(self, key: str) -> int:
        value = self.config.get(key)
        if type(value) is not int or value <= 0:
            raise self.fail(f"{key} is {value!r}, not a positive integer")
        return value

    def real(self, key: str) -> float:
        value = self.config.get(key)
        if type(value) not in (int, float) or not 0 < value < float("inf"):
            raise self.fail(f"{key} is {value!r}, not a positive number")
        return float(value)

    def refuse(self, key: str, what: str, allowed: object = None) -> None:
        """Fail if config.json sets `key` to anything but `allowed`: a feature pyml lacks."""
        value = self.config.get(key, allowed)
        if value != allowed:
            raise self.fail(f"{what} is not supported ({key} is {value!r})")


def read_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PymlError(f"{path}: missing; a Hugging Face model folder holds config.json") from None
    except (OSError, ValueError) as error:
        raise PymlError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise PymlError(f"{path}: not a JSON object")
    return config


def architecture_of_config(config: dict, path: Path) -> tuple[Llama, bool]:
    """(the architecture with the dims config.json states, whether the head is tied to the
    embedding), checked as an import of the model's GGUF checks them."""
    named = config.get("architectures")
    known = ", ".join(ARCHITECTURES)
    if not (isinstance(named, list) and len(named) == 1 and named[0] in ARCHITECTURES):
        raise PymlError(f"{path}: architectures is {named!r}; pyml runs one of {known}")
    model_type, architecture = ARCHITECTURES[named[0]]
    if config.get("model_type") != model_type:
        raise PymlError(f"{path}: model_type is {config.get('model_type')!r}, but {named[0]}'s is "
                        f"{model_type!r}")
    fields = ConfigFields(config, path)
    dims = read_dims(fields, architecture, model_type)
    tied = fields.config.get("tie_word_embeddings")
    if type(tied) is not bool:
        raise fields.fail(f"tie_word_embeddings is {tied!r}, not true or false")
    return architecture.of_dims(dims, path), tied


def read_dims(fields: ConfigFields, architecture: type[Llama], model_type: str) -> LlamaDims:
    config = fields.config
    hidden, n_heads = fields.integer("hidden_size"), fields.integer("num_attention_heads")
    n_kv_heads, head_dim = fields.integer("num_key_value_heads"), fields.integer("head_dim")
    if n_heads % n_kv_heads:
        raise fields.fail(f"num_attention_heads {n_heads} do not share num_key_value_heads {n_kv_heads}")
    if head_dim % 2:
        raise fields.fail(f"head_dim {head_dim} is odd; rotary embeddings need pairs")
    activation_key = "hidden_activation" if architecture is Gemma3 else "hidden_act"
    activation = "gelu_pytorch_tanh" if architecture is Gemma3 else "silu"
    fields.refuse(activation_key, "an MLP activation other than " + activation, activation)
    if architecture is Llama:
        fields.refuse("attention_bias", "biases on the attention's projections", False)
        fields.refuse("mlp_bias", "biases on the MLP's projections", False)
    if architecture is Qwen3:
        fields.refuse("attention_bias", "biases on the attention's projections", False)
    if model_type == "mistral":
        fields.refuse("sliding_window", "sliding-window attention in a Mistral model")
    if model_type in ("qwen2", "qwen3"):
        fields.refuse("use_sliding_window", "sliding-window attention", False)
    rope_dims = head_dim
    if architecture is Phi3:
        factor = fields.real("partial_rotary_factor")
        rope_dims = round(head_dim * factor)
        if rope_dims > head_dim or rope_dims % 2 or rope_dims != head_dim * factor:
            raise fields.fail(f"partial_rotary_factor {factor} does not rotate an even part of heads "
                              f"of {head_dim}")
    common = dict(
        hidden=hidden,
        n_layers=fields.integer("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=fields.integer("intermediate_size"),
        vocab=fields.integer("vocab_size"),
        context_length=fields.integer("max_position_embeddings"),
        rms_norm_eps=fields.real("rms_norm_eps"),
        rope_theta=fields.real("rope_theta"),
        rope_dims=rope_dims,
        rope_scaling=rope_scaling(fields, architecture),
    )
    if architecture is Phi3:
        window = config.get("sliding_window")
        if window is not None and (type(window) is not int or window <= 0):
            raise fields.fail(f"sliding_window is {window!r}, not a count of positions or null")
        return Phi3Dims(**common, sliding_window=window or 0,
                        original_context_length=fields.integer("original_max_position_embeddings"))
    if architecture is Gemma3:
        fields.refuse("attn_logit_softcapping", "attention logit soft-capping")
        fields.refuse("final_logit_softcapping", "final logit soft-capping")
        return Gemma3Dims(**common, sliding_window=fields.integer("sliding_window"),
                          sliding_pattern=sliding_pattern(fields, common["n_layers"]),
                          rope_local_theta=fields.real("rope_local_base_freq"),
                          query_pre_attn_scalar=fields.integer("query_pre_attn_scalar"))
    return LlamaDims(**common)


def rope_scaling(fields: ConfigFields, architecture: type[Llama]) -> dict | None:
    """The spec's RoPE scaling of config.json's `rope_scaling`, of the types the architecture
    takes, with exactly the parameters the spec holds."""
    scaling = fields.config.get("rope_scaling")
    if scaling is None:
        return None
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ROPE_SCALINGS[architecture]:
        taken = " or ".join(ROPE_SCALINGS[architecture]) or "none"
        raise fields.fail(f"rope_scaling of type {kind!r} is not supported for "
                          f"{architecture.hf_class} (it takes {taken})")
    unknown = set(scaling) - set(SCALING_FIELDS[kind]) - set(SCALING_NOTES)
    if unknown:
        raise fields.fail(f"rope_scaling's {', '.join(sorted(unknown))} is not supported "
                          f"(pyml's {kind} scaling takes {', '.join(SCALING_FIELDS[kind])})")
    missing = [key for key in SCALING_FIELDS[kind] if scaling.get(key) is None]
    if missing:
        raise fields.fail(f"rope_scaling of type {kind!r} lacks {', '.join(missing)}")
    return {"type": kind} | {key: scaling[key] for key in SCALING_FIELDS[kind]}


def sliding_pattern(fields: ConfigFields, n_layers: int) -> int:
    """Gemma 3's period of sliding-window layers: layer l attends globally when (l + 1) % period
    is 0. config.json lists each layer's type; the spec takes them as that period."""
    types = fields.config.get("layer_types")
    kinds = ("sliding_attention", "full_attention")
    if not (isinstance(types, list) and len(types) == n_layers and all(kind in kinds for kind in types)):
        raise fields.fail(f"layer_types is {types!r}, not {n_layers} of {' or '.join(kinds)}")
    full = [layer for layer, kind in enumerate(types) if kind == "full_attention"]
    period = full[0] + 1 if full else n_layers + 1
    if types != ["sliding_attention" if (layer + 1) % period else "full_attention"
                 for layer in range(n_layers)]:
        raise fields.fail("layer_types is not one global layer after every few sliding-window "
                          "ones, which pyml's Gemma 3 spec repeats")
    return period


def folder_spec(folder: Path, name: str | None = None) -> dict[str, object]:
    """The pyml spec data of the model in a Hugging Face `folder`, from its config.json; named
    `name`, by default after the folder."""
    config_path = Path(folder) / CONFIG_FILE
    architecture, tied = architecture_of_config(read_config(folder), config_path)
    return architecture.spec(name or spec_name(folder), tied)


def folder_spec_text(folder: Path, name: str | None = None) -> str:
    """`folder_spec` as the text of a spec file. Its comment names no path: the cache keeps one
    entry for every folder of the same spec, and a checkpoint copies the text."""
    return spec_toml(folder_spec(folder, name), "made by pyml from a Hugging Face config.json")


def expected_tensors(architecture: Llama, tied: bool) -> dict[str, tuple[int, ...]]:
    """The weights a Hugging Face folder of the model holds (name -> shape)."""
    derived = architecture.derived_tensors()  # llama.cpp's, which follow from the config
    return {architecture.hf_name(name): shape
            for name, shape in architecture.expected_shapes(tied).items() if name not in derived}


def weight_files(folder: Path) -> tuple[list[str], StoredFolder]:
    """(the files that hold the folder's weights: model.safetensors, or the index and its shards;
    the weights as stored, every file checked to be there, whole, and of a weight dtype)."""
    stored = StoredFolder(folder)
    if (folder / MODEL_FILE).is_file():
        return [MODEL_FILE], stored
    if (folder / INDEX_FILE).is_file():
        shards = sorted(set(json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"].values()))
        return [INDEX_FILE, *shards], stored
    raise PymlError(f"{folder}: holds no {MODEL_FILE} nor {INDEX_FILE}: a Hugging Face model "
                    "folder's weights are safetensors")


def check_weights(folder: Path, stored: StoredFolder, architecture: Llama, tied: bool) -> None:
    """The folder's weights are those config.json's model has, by name and shape."""
    expected = expected_tensors(architecture, tied)
    missing = [name for name in expected if name not in stored.tensors]
    unexpected = [name for name in stored.tensors if name not in expected]
    for names, what in ((missing, "lacks"), (unexpected, "holds")):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise PymlError(f"{folder}: {what} {shown}, which config.json's model "
                            f"{'has' if what == 'lacks' else 'does not have'}")
    for name, shape in expected.items():
        if stored.tensors[name].shape != shape:
            raise PymlError(f"{folder}: tensor {name} has shape {stored.tensors[name].shape}; "
                            f"config.json's model has {shape}")


def import_hf(folder: Path, out_dir: Path, name: str | None = None, overwrite: bool = False,
              copy: bool = False, progress: bool = True) -> Path:
    """Write the model folder of the Hugging Face `folder` into `out_dir`: spec.toml (called
    `name`, default after `out_dir`), the description files as they are, chat_template.jinja from
    tokenizer_config.json's template when the folder has none, and the weight files as absolute
    symbolic links to `folder`'s (with `copy`, copies). Everything is checked first. An existing
    `out_dir` is replaced whole when it is an empty or a model folder, otherwise only with
    `overwrite`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PymlError(f"{folder}: no such folder (import-hf takes a Hugging Face model folder)")
    out_dir = check_destination(Path(out_dir), "a model folder", is_model_folder, overwrite)
    if out_dir.resolve() == folder.resolve() or folder.resolve().is_relative_to(out_dir.resolve()):
        raise PymlError(f"{folder} is --out {out_dir} or inside it, which the import replaces: "
                        "write the model folder somewhere else")
    config_path = folder / CONFIG_FILE
    architecture, tied = architecture_of_config(read_config(folder), config_path)
    weights, stored = weight_files(folder)
    check_weights(folder, stored, architecture, tied)
    if not (folder / "tokenizer.json").is_file():
        raise PymlError(f"{folder / 'tokenizer.json'}: missing; pyml reads the tokenizer from it")
    files = {SPEC_FILE: spec_toml(architecture.spec(name or spec_name(out_dir), tied),
                                  f"written by `pyml import-hf` from {folder.resolve()}").encode("utf-8")}
    for file_name in DESCRIPTION_FILES:
        if (folder / file_name).is_file():
            files[file_name] = (folder / file_name).read_bytes()
    template = json.loads(files.get("tokenizer_config.json", b"{}")).get("chat_template")
    if isinstance(template, str) and "chat_template.jinja" not in files:
        files["chat_template.jinja"] = template.encode("utf-8")

    with tqdm(total=len(weights) + len(files), disable=not progress, unit="file") as bar:
        try:
            with written_folder(out_dir) as written:
                for file_name in weights:
                    source = (folder / file_name).resolve()
                    bar.set_description(f"{'copying' if copy else 'linking'} {file_name}")
                    if copy:
                        shutil.copyfile(source, written / file_name)
                    else:
                        (written / file_name).symlink_to(source)
                    bar.update()
                for file_name, content in files.items():
                    bar.set_description(f"writing {file_name}")
                    (written / file_name).write_bytes(content)
                    bar.update()
        except OSError as error:
            raise PymlError(f"{out_dir}: cannot write the model: {os_error(error)}") from None
    return out_dir
