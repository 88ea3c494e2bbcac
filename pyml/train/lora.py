"""LoRA runs: the spec a `pyml train --lora-rank` run trains, its checkpoints in the `peft`
library's adapter layout, and `pyml merge-lora`, which folds an adapter into its base.

A LoRA checkpoint holds the adapters only, as `peft`'s `save_pretrained` writes them, so that
`PeftModel.from_pretrained(base, CHECKPOINT)` loads it:

    adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules
                               (q_proj, v_proj, ...), base_model_name_or_path (the --init folder)
    adapter_model.safetensors  A and B of every adapted projection, under peft's names:
                               base_model.model.<the base tensor's name less .weight>.lora_A.weight
    tokenizer.json, tokenizer_config.json, chat_template.jinja (the base's, where it has them)

The base weights stay in the --init folder: a checkpoint is a few MB, not a copy of the model.
`merge-lora` (and `pyml generate --adapter`) read any plain LoRA adapter folder of the base, as
peft writes one, not only ours.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.model_folder import (
    ADAPTER_CONFIG_FILE,
    DESCRIPTION_FILES,
    GENERAL_FILE,
    MODEL_FILE,
    SOURCE_GGUF,
    SPEC_FILE,
    is_model_folder,
)
from pyml.weight_formats import GGMLType
from pyml.formats.safetensors_io import read_safetensors, write_safetensors
from pyml.formats.stored_tensors import StoredFolder
from pyml.outputs import atomic_write, check_destination, os_error, written_folder

ADAPTER_MODEL_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's wrapper (PeftModel.base_model.model) in tensor names
# The spec's LoRA targets as the projections' module names in Hugging Face's Llama, Gemma 3 and Phi-3.
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
                "qkv": "qkv_proj", "gate_up": "gate_up_proj"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LORA_FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets"}


def base_weights_digest(init: Path) -> str:
    """The sha256 of the base's weights files (source.gguf, model.safetensors or the shards, their
    bytes one after the other): a LoRA checkpoint holds only adapters, so a resume must find the
    base weights they were trained on (about half a second for SmolLM2)."""
    init = Path(init)
    digest = hashlib.sha256()
    for path in StoredFolder(init).files if init.is_dir() else [init]:
        try:
            with path.open("rb") as file:
                while chunk := file.read(1 << 24):
                    digest.update(chunk)
        except OSError as error:
            raise PymlError(f"{path}: cannot read the base weights ({error.strerror})") from None
    return digest.hexdigest()


def parse_targets(text: str) -> list[str]:
    """`--lora-targets q,k,v` as a list; the spec's check names any unknown one."""
    return [target.strip() for target in text.split(",") if target.strip()]


def lora_settings(rank: int, alpha: float | None, targets: list[str] | None) -> dict:
    """The [lora] table of the flags, the spec language's defaults filled in (recorded in
    state.json, so that a resume can compare)."""
    from pyml.spec.layers import LoRA

    fields = LoRA.model_fields  # the defaults only: the spec's check judges the values
    return {"rank": rank, "alpha": fields["alpha"].get_default() if alpha is None else alpha,
            "targets": fields["targets"].get_default() if targets is None else targets}


def lora_spec(spec_path: Path, settings: dict):
    """(spec, package) of the spec at `spec_path` with the [lora] table `settings` added, checked
    as `pyml gen` checks a spec, generated into pyml's cache (never into a project's gen/)."""
    from pyml.packages import derived_package
    from pyml.spec import parse_spec

    data = tomllib.loads(Path(spec_path).read_text(encoding="utf-8"))
    if "lora" in data:
        raise PymlError(f"{spec_path} already has a [lora] table: train it without --lora-rank, "
                        "--lora-alpha and --lora-targets, or remove the table")
    data["lora"] = settings
    # checked here so that an error names the user's spec and flags, not the derived file
    parse_spec(data, f"{spec_path} with --lora-rank {settings['rank']}")
    return derived_package(data)


def adapter_config(lora, base: str) -> dict:
    """What `peft.LoraConfig(...).save_pretrained` writes for this adapter (the keys that define
    it; peft fills the others with their defaults when it reads the file)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": sorted(PEFT_MODULES[target] for target in lora.targets),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
        "alpha_pattern": {},
    }  # fmt: skip


def adapter_files(lora, init: Path) -> dict[str, bytes]:
    """The files a LoRA checkpoint holds beside the adapters: adapter_config.json and the
    tokenizer files of the base folder `init`."""
    config = json.dumps(adapter_config(lora, str(init)), indent=2) + "\n"
    files = {ADAPTER_CONFIG_FILE: config.encode("utf-8")}
    for name in TOKENIZER_FILES:
        if (Path(init) / name).is_file():
            files[name] = (Path(init) / name).read_bytes()
    return files


def write_adapter_folder(folder: Path, model, files: dict[str, bytes]) -> None:
    """Write a LoRA `model`'s adapters under peft's names, and `files`, into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name: np.ascontiguousarray(tensor)
               for name, tensor in model.adapter_tensors().items()}
    write_safetensors(folder / ADAPTER_MODEL_FILE, tensors)
    for name, content in files.items():
        atomic_write(folder / name, lambda handle, content=content: handle.write(content))


def read_adapter_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The adapters of a peft adapter folder under our tensor names (no wrapper prefix)."""
    path = Path(folder) / ADAPTER_MODEL_FILE
    tensors = read_safetensors(path)
    foreign = [name for name in tensors if not name.startswith(PEFT_PREFIX)]
    if foreign:
        raise PymlError(f"{path}: tensor {foreign[0]} is not named as peft names a LoRA "
                        f"adapter ({PEFT_PREFIX}...lora_A.weight)")
    return {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in tensors.items()}


def read_adapter_config(folder: Path) -> dict:
    path = Path(folder) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise PymlError(f"{path}: missing; ADAPTER must be a LoRA checkpoint of `pyml train "
                        "--lora-rank` or a folder peft's save_pretrained wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise PymlError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None
    if config.get("peft_type") != "LORA":
        raise PymlError(f"{path}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise PymlError(f"{path}: {key} is set; merge-lora folds plain LoRA adapters only")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise PymlError(f"{path}: {key} is set; merge-lora folds one rank and alpha only")
    if not (isinstance(config.get("r"), int) and config["r"] > 0
            and isinstance(config.get("lora_alpha"), (int, float))):
        raise PymlError(f"{path}: needs a positive integer r and a number lora_alpha")
    return config


def adapter_pairs(stored: StoredFolder, adapter: Path) -> tuple[dict[str, tuple], float]:
    """{base weight name: (lora_A, lora_B)} of a peft adapter folder, every adapter tensor checked
    against the base's weights (`stored`), and the adapters' scale lora_alpha / r."""
    config = read_adapter_config(adapter)
    adapters = read_adapter_tensors(adapter)
    base_path = stored.path / stored.source
    adapter_path = Path(adapter) / ADAPTER_MODEL_FILE
    if not adapters:
        raise PymlError(f"{adapter_path}: holds no adapter tensors")
    for name in adapters:
        if not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise PymlError(f"{adapter_path}: {PEFT_PREFIX}{name} is neither a lora_A nor a "
                            "lora_B weight")
    pairs = {}
    for module in sorted({name.rsplit(".lora_", 1)[0] for name in adapters}):
        names = {part: f"{module}.lora_{part}.weight" for part in "AB"}
        for name in names.values():
            if name not in adapters:
                raise PymlError(f"{adapter_path}: {PEFT_PREFIX}{name} missing")
        down, up = adapters[names["A"]], adapters[names["B"]]
        weight_name = f"{module}.weight"
        if weight_name not in stored.tensors:
            raise PymlError(f"{adapter_path}: adapts {weight_name}, which {base_path} does not "
                            "hold; is ADAPTER an adapter of this base?")
        shape = tuple(stored.tensors[weight_name].shape)
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != config["r"] or up.shape != (
                shape[0], config["r"]) or down.shape[1] != shape[1]:
            raise PymlError(
                f"{adapter_path}: {module} has lora_A {down.shape} and lora_B {up.shape}; the base's "
                f"{weight_name} {shape} with r {config['r']} needs lora_A "
                f"({config['r']}, {shape[1]}) and lora_B ({shape[0]}, {config['r']})")
        pairs[weight_name] = (down, up)
    return pairs, config["lora_alpha"] / config["r"]


def merged(weight: np.ndarray, pair: tuple, scale: float) -> np.ndarray:
    """W + scale B A, added in float64, in W's dtype."""
    down, up = pair
    update = up.astype(np.float64) @ down.astype(np.float64)
    return (weight.astype(np.float64) + scale * update).astype(weight.dtype)


def merged_tensors(base: Path, adapter: Path) -> dict[str, np.ndarray]:
    """The base folder's tensors with every adapted projection W replaced by
    W + (lora_alpha / r) B A, in W's dtype; every adapter tensor checked against the base."""
    stored = StoredFolder(base)
    pairs, scale = adapter_pairs(stored, adapter)
    # float32, or float64 where the base stores it (the reference tests' checkpoints): the merge
    # adds in float64 and rounds back to this
    tensors = {name: tensor.dense(np.float64 if tensor.ggml_type == GGMLType.F64 else np.float32)
               for name, tensor in stored.tensors.items()}
    return tensors | {name: merged(tensors[name], pair, scale) for name, pair in pairs.items()}


class RequantizationError:
    """How far requantizing merged matrices to their stored types moves them from the float merge:
    sums over every merged matrix of the squared error and of the squared values (relative RMS)."""

    def __init__(self):
        self.squared_error = self.squared_values = 0.0
        self.types: set[str] = set()

    def measured(self, values: np.ndarray, kind: GGMLType) -> np.ndarray:
        from pyml.weight_formats import ENCODABLE, dequantize, quantize

        if kind in ENCODABLE and len(values.shape) == 2 and kind not in (GGMLType.F32,):
            encoded = quantize(values, kind)
            error = dequantize(encoded.reshape(-1).view(np.uint8), kind, values.shape) - values
            self.squared_error += float(np.sum(error.astype(np.float64) ** 2))
            self.types.add(kind.name)
        self.squared_values += float(np.sum(values.astype(np.float64) ** 2))
        return values

    def describe(self, count: int) -> str:
        relative = (self.squared_error / self.squared_values) ** 0.5 if self.squared_values else 0.0
        return (f"merged {count} matrices, requantized to their stored types "
                f"({'/'.join(sorted(self.types)) or 'none'}): {100 * relative:.3f}% relative RMS error "
                "against the float merge")


def low_rank_updates(adapter: Path, linears, n_layers: int, tensors: dict) -> dict[str, tuple]:
    """The update a peft LoRA adapter folder adds to each linear op of a fused decode step, kept
    beside the base's stored rows (`pyml.package.decode_cpu.with_low_rank`): {op prefix: (down,
    up)}, down (layers, R, in) the A of each adapted row block stacked, up (layers, rows, R) its
    (lora_alpha / r) B in that block's rows, zero elsewhere. `linears` are the step's LINEARS,
    `tensors` the base's (StoredTensors by name, to check each A's width against its matrix's).
    Every adapter tensor must adapt one of the ops' matrices, as in `merged_tensors`."""
    config, adapters = read_adapter_config(adapter), read_adapter_tensors(adapter)
    adapter_path, rank = Path(adapter) / ADAPTER_MODEL_FILE, config["r"]
    if not adapters:
        raise PymlError(f"{adapter_path}: holds no adapter tensors")
    scale = config["lora_alpha"] / rank
    used, updates = set(), {}
    for prefix, _, _, parts in linears:
        layers = n_layers if "{l}" in parts[0][0] else 1
        blocks = [(pattern, first, last) for pattern, first, last in parts
                  if pattern.format(l=0).removesuffix(".weight") + ".lora_A.weight" in adapters]
        if not blocks:
            continue
        columns = tensors[parts[0][0].format(l=0)].shape[1]
        down = np.zeros((layers, rank * len(blocks), columns), np.float32)
        up = np.zeros((layers, parts[-1][2], rank * len(blocks)), np.float32)
        for layer in range(layers):
            for index, (pattern, first, last) in enumerate(blocks):
                module = pattern.format(l=layer).removesuffix(".weight")
                names = [f"{module}.lora_{part}.weight" for part in "AB"]
                missing = [name for name in names if name not in adapters]
                if missing:
                    raise PymlError(f"{adapter_path}: {PEFT_PREFIX}{missing[0]} missing")
                a, b = (adapters[name] for name in names)
                if a.shape != (rank, columns) or b.shape != (last - first, rank):
                    raise PymlError(
                        f"{adapter_path}: {module} has lora_A {a.shape} and lora_B {b.shape}; the "
                        f"base's {module}.weight {(last - first, columns)} with r {rank} needs lora_A "
                        f"({rank}, {columns}) and lora_B ({last - first}, {rank})")
                span = slice(index * rank, (index + 1) * rank)
                down[layer, span] = a
                up[layer, first:last, span] = scale * b.astype(np.float64)
                used.update(names)
        updates[prefix] = (down, up)
    unused = sorted(set(adapters) - used)
    if unused:
        raise PymlError(f"{adapter_path}: {PEFT_PREFIX}{unused[0]} adapts no linear map of the base "
                        "(is ADAPTER an adapter of this base?)")
    return updates


def merge_lora(base: Path, adapter: Path, out: Path, overwrite: bool = False,
               weights: str = "as-stored", say=print) -> Path:
    """Write the model folder of `base` with `adapter` folded in to `out`, with the base's
    spec.toml (a spec without [lora]), config, tokenizer and chat template. Its weights: for a
    base that holds a GGUF and `weights` "as-stored", a GGUF of its own (source.gguf) in the
    base's types, each merged matrix requantized to its type (the error that adds against the
    float merge is said through `say`) and every other tensor's bytes as they were, so the merged
    model costs what the base does; otherwise ("f32") model.safetensors in float32 (float64 where
    the base stores it), which transformers loads. Every input is checked before anything is
    written; `out` is written whole, replacing an empty or a model folder there (anything else
    only with `overwrite`), so nothing of an older folder there survives."""
    base, adapter, out = Path(base), Path(adapter), Path(out)
    for folder, what in ((base, "BASE"), (adapter, "ADAPTER")):
        if not folder.is_dir():
            raise PymlError(f"{folder}: not a folder ({what})")
    if not (base / SPEC_FILE).is_file() and not (base / "config.json").is_file():
        raise PymlError(f"{base / SPEC_FILE}: missing; BASE must be a model folder from "
                        "`pyml import-gguf` or `pyml import-hf`, a Hugging Face model folder or "
                        "a full fine-tune's checkpoint")
    from pyml.packages import spec_file

    base_spec = spec_file(base)  # a Hugging Face folder's is made from its config.json
    if "lora" in tomllib.loads(base_spec.read_text(encoding="utf-8")):
        raise PymlError(f"{base_spec} has a [lora] table: BASE must be a model "
                        "without adapters")
    if out.resolve() in (base.resolve(), adapter.resolve()):
        raise PymlError(f"--out {out} is {'BASE' if out.resolve() == base.resolve() else 'ADAPTER'}: "
                        "write the merged model to another folder")
    if weights not in ("as-stored", "f32"):
        raise PymlError(f"--weights must be as-stored or f32, not {weights!r}")
    check_destination(out, "a model folder", is_model_folder, overwrite)
    stored = StoredFolder(base)
    in_gguf = weights == "as-stored" and stored.source == SOURCE_GGUF
    if in_gguf:
        from pyml.formats.gguf_export import export_gguf, general_metadata

        pairs, scale = adapter_pairs(stored, adapter)
        error = RequantizationError()
        replaced = {name: (lambda name=name: error.measured(
            merged(stored.tensors[name].dense(np.float32), pairs[name], scale), stored.tensors[name].ggml_type))
            for name in pairs}
    else:
        tensors = merged_tensors(base, adapter)
    try:
        with written_folder(out) as folder:
            if in_gguf:
                export_gguf(base, folder / SOURCE_GGUF, "as-stored", progress=False, replaced=replaced)
                (folder / GENERAL_FILE).write_text(
                    json.dumps(general_metadata(base, fine_tune=True), indent=2) + "\n", encoding="utf-8")
            else:
                write_safetensors(folder / MODEL_FILE, tensors)
            (folder / SPEC_FILE).write_bytes(base_spec.read_bytes())
            for name in DESCRIPTION_FILES:
                if (base / name).is_file() and not (in_gguf and name == GENERAL_FILE):
                    (folder / name).write_bytes((base / name).read_bytes())
    except OSError as error:
        raise PymlError(f"{out}: cannot write the merged model: {os_error(error)}") from None
    if in_gguf:
        say(error.describe(len(pairs)))
    return out
