"""`pyml export-gguf`: a model folder written as a GGUF file that llama.cpp, ollama and
transformers load.

The folder is what `pyml import-gguf` writes and what every checkpoint of a run started from one
holds (`pyml.formats.model_folder`): a llama, qwen2, qwen3, phi3 or gemma3 model. We write what llama.cpp's converter
(convert_hf_to_gguf.py) writes for it, with the `gguf` package's writer:

- the architecture's metadata from config.json, under the keys `gguf_architectures` reads;
- the `general.*` metadata of the GGUF the folder came from (gguf_general.json: name, license,
  base models, tags, ...), as it was for a folder imported from it; for a fine-tune (a folder
  whose weights are its own: a checkpoint, a merged LoRA), the source becomes its base model
  (`general.base_model.0.*`, as llama.cpp's converter records one), its name gets the suffix
  " (fine-tune)", and the keys that identify the source's own release are left out;
- the tokenizer from tokenizer.json and tokenizer_config.json: the tokens, their kinds, the BPE
  merges (byte-level vocabularies) or the token scores (SentencePiece ones), the special token
  ids, the flags that add BOS/EOS or a space in front, and the chat template;
- the tensors under GGUF names, changed back as the converter changes them: llama's Q and K rows
  reordered (its `permute`), Gemma's norm gains stored as 1 + w; 1-D tensors in float32 and the
  others in the `--type` asked for (F16 where a row is no whole number of blocks, as there), or
  for a K-quant type in the mix `llama-quantize` makes of the same name (`tensor_type`), encoded
  by llama.cpp's reference quantisers (pyml/weight_formats), so that the bytes are the ones
  `llama-quantize` writes from our f32 export.

Everything is checked before a byte is written, the strongest way we know: the metadata must read
back, through the importer's own code (`architecture_of`, `build_tokenizer`), as the folder's
config.json, generation_config.json, tokenizer.json and tokenizer_config.json, and the tensors
must be those the config describes. A folder that fails is refused with one line; the file is
written to a temporary name and renamed into place, so nothing is left half written.

A SentencePiece vocabulary's scores are not in tokenizer.json, which holds the merges they rank.
llama.cpp merges the pair that makes the highest-scoring token first, so we give each token the
rank of the first merge that makes it, negated: the same order, hence the same tokens (for the
shipped Gemma 3, the same order of all its normal tokens as the scores its converter wrote). Added
tokens get -1000 and byte tokens 0, as the converter gives them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import (
    LONGROPE_FACTORS,
    ROPE_FACTORS,
    Llama,
    architecture_of,
    llama3_rope_factors,
)
from pyml.formats.gguf_read import GGUFFile, GGUFTensor
from pyml.formats.model_folder import GENERAL_FILE, SOURCE_GGUF, is_adapter_folder
from pyml.weight_formats import ENCODABLE, FORMATS, GGMLType, quantize, tensor_nbytes
from pyml.formats.stored_tensors import StoredFolder, StoredTensor
from pyml.formats.tokenizer import (
    CONTROL_TOKEN,
    NORMAL_TOKEN,
    UNKNOWN_TOKEN,
    USER_DEFINED_TOKEN,
    build_tokenizer,
    special_token_id,
    tokenizer_config,
)
from pyml.outputs import check_destination, os_error, written_file

# --type -> the GGML type of the 2-D tensors, and general.file_type (llama.cpp's llama_ftype).
# The K-quant types are llama-quantize's mixes of the same names (`tensor_type`).
EXPORT_TYPES = {
    "f32": (GGMLType.F32, 0),
    "f16": (GGMLType.F16, 1),
    "q8_0": (GGMLType.Q8_0, 7),
    "q4_0": (GGMLType.Q4_0, 2),
    "q4_1": (GGMLType.Q4_1, 3),
    "q4_k_m": (GGMLType.Q4_K, 15),
    "q5_k_m": (GGMLType.Q5_K, 17),
    "q6_k": (GGMLType.Q6_K, 18),
    "as-stored": (None, None),  # each tensor in the type the folder stores it (where pyml writes it)
}
# general.file_type of a file whose matrices are mostly of a type (llama_ftype; the K types' _M mixes)
FILE_TYPES = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.Q8_0: 7,
              GGMLType.Q5_0: 8, GGMLType.Q5_1: 9, GGMLType.Q4_K: 15, GGMLType.Q5_K: 17, GGMLType.Q6_K: 18}
K_QUANTS = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
# llama-quantize's type for a matrix whose rows are no whole number of the asked type's blocks
FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}
# config.json's model_type -> the GGUF architecture.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "gemma3_text": "gemma3"}
BYTE_TOKEN = 6  # llama.cpp's LLAMA_TOKEN_TYPE_BYTE: <0x00>..<0xFF> of a SentencePiece vocabulary
ADDED_TOKEN_SCORE = -1000.0  # what the converter scores added (control, user-defined) tokens
# the source's general.* keys an export leaves out: who quantized the source file (pyml quantizes
# this one); for a fine-tune, also those of the source's own release, which become the keys of its
# base model (BASE_MODEL_FIELDS), and its provenance and data sets
NOT_CARRIED = ("general.quantized_by",)
NOT_CARRIED_BY_A_FINE_TUNE = ("general.description", "general.source.", "general.base_model.",
                              "general.dataset.")
BASE_MODEL_FIELDS = ("name", "author", "version", "organization", "url", "doi", "uuid", "repo_url")
FINE_TUNE_SUFFIX = " (fine-tune)"
SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def export_gguf(model_dir: Path, out: Path, type_name: str = "f32", progress: bool = True,
                overwrite: bool = False, replaced: dict | None = None, fine_tune: bool = False) -> Path:
    """Write the model in `model_dir` as a GGUF at `out`, its matrices as `type_name` ("as-stored":
    each in the type the folder stores it; a GGUF's tensors then keep their bytes). An existing
    GGUF at `out` is replaced; any other file only with `overwrite` (`pyml.outputs`). With
    `progress`, a progress bar on stderr, then, as llama-quantize says it, how many tensors fell
    back to another type. `replaced` ({name: a function giving its float32 values}) replaces
    those tensors' values, each computed when it is written (`pyml merge-lora`), and makes the file
    a fine-tune of the folder's model, as does `fine_tune`."""
    if type_name not in EXPORT_TYPES:
        raise PymlError(
            f"--type {type_name!r} is not one pyml writes (only {', '.join(EXPORT_TYPES)})"
        )
    matrix_type, file_type = EXPORT_TYPES[type_name]
    model_dir, out = Path(model_dir), Path(out)
    if out.is_dir():
        raise PymlError(f"{out}: is a folder; give the GGUF file to write")
    check_destination(out, "a GGUF file", is_gguf_file, overwrite)
    if is_adapter_folder(model_dir):
        raise PymlError(f"{model_dir} holds LoRA adapters, not a model: fold them into their base "
                        "first (`pyml merge-lora BASE ADAPTER --out DIR`), then export DIR")
    config = _read_json(model_dir / "config.json")
    tokenizer = _read_json(model_dir / "tokenizer.json")
    settings = _read_json(model_dir / "tokenizer_config.json")
    metadata = (architecture_metadata(model_dir, config)
                | general_metadata(model_dir, fine_tune or bool(replaced))
                | tokenizer_metadata(model_dir, tokenizer, settings))
    described = GGUFFile(path=model_dir, version=3, metadata=metadata,
                         tensors=rope_factor_tensors(model_dir, config))
    architecture = architecture_of(described)
    _check_reads_back(model_dir, described, architecture, config, tokenizer, settings)
    stored = StoredFolder(model_dir)  # decoded one tensor at a time as it is written
    tensors = dict(stored.tensors)
    plan = _tensor_plan(stored.path / stored.source, tensors, architecture, config, matrix_type)
    if matrix_type is None:
        kinds = [kind for _, hf_name, shape, kind in plan if hf_name is not None and len(shape) == 2]
        file_type = FILE_TYPES[max(set(kinds), key=kinds.count)]
    # as stored, a GGUF's tensor keeps its bytes, unless its values are replaced (an asked type is
    # encoded from the Hugging Face values, as llama.cpp's converter encodes them)
    raw = ({name for name, tensor in tensors.items() if name not in (replaced or {})}
           if stored.source == SOURCE_GGUF and matrix_type is None else set())
    for name, values in (replaced or {}).items():
        tensors[name] = ComputedTensor(tensors[name].ggml_type, values)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with written_file(out) as temporary:
            _write(temporary, architecture, metadata, tensors, plan, file_type,
                   out.name if progress else "", raw)  # fmt: skip
    except OSError as error:
        raise PymlError(f"{out}: cannot write: {os_error(error)}") from None
    fell_back = fallbacks(plan, architecture, config, matrix_type)
    if progress and fell_back:
        counts = {kind.name: sum(1 for other in fell_back.values() if other == kind)
                  for kind in dict.fromkeys(fell_back.values())}
        print(f"{out.name}: {len(fell_back)} of {len(plan)} tensors fell back to another type, their "
              f"rows being no whole number of {matrix_type.name}'s blocks (as llama-quantize's "
              f"would): " + ", ".join(f"{n} to {kind}" for kind, n in counts.items()), file=sys.stderr)
    return out


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


# -- what the file says


def architecture_metadata(model_dir: Path, config: dict) -> dict[str, object]:
    """The `general.*` and `{architecture}.*` metadata of the model config.json describes."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise PymlError(
            f"{model_dir / 'config.json'}: model_type {model_type!r} cannot be exported to GGUF "
            f"(only {', '.join(ARCHITECTURES)})"
        )
    name = ARCHITECTURES[model_type]

    def value(key: str, kind: type):
        found = config.get(key)
        if type(found) is not kind:
            raise PymlError(
                f"{model_dir / 'config.json'}: {key} is {found!r}, not a {kind.__name__}"
            )
        # float32 in the file: what the importer reads back, as it reads a converted file
        return float(np.float32(found)) if kind is float else found

    head_dim = value("head_dim", int)
    metadata: dict[str, object] = {
        "general.architecture": name,
        "general.type": "model",
        f"{name}.context_length": value("max_position_embeddings", int),
        f"{name}.embedding_length": value("hidden_size", int),
        f"{name}.block_count": value("num_hidden_layers", int),
        f"{name}.feed_forward_length": value("intermediate_size", int),
        f"{name}.attention.head_count": value("num_attention_heads", int),
        f"{name}.attention.head_count_kv": value("num_key_value_heads", int),
        f"{name}.attention.key_length": head_dim,
        f"{name}.attention.value_length": head_dim,
        f"{name}.attention.layer_norm_rms_epsilon": value("rms_norm_eps", float),
        f"{name}.rope.freq_base": value("rope_theta", float),
    }
    if name in ("llama", "qwen2", "qwen3"):
        metadata[f"{name}.vocab_size"] = value("vocab_size", int)
        metadata[f"{name}.rope.dimension_count"] = head_dim
    elif name == "phi3":  # as llama.cpp's Phi3MiniModel writes it; a window of 0: none
        metadata["phi3.rope.dimension_count"] = round(value("partial_rotary_factor", float) * head_dim)
        metadata["phi3.rope.scaling.original_context_length"] = value("original_max_position_embeddings", int)
        metadata["phi3.attention.sliding_window"] = config.get("sliding_window") or 0
    else:
        metadata["gemma3.attention.sliding_window"] = value("sliding_window", int)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type") == "linear":
        metadata[f"{name}.rope.scaling.type"] = "linear"
        metadata[f"{name}.rope.scaling.factor"] = float(np.float32(scaling.get("factor")))
    if name == "phi3" and isinstance(scaling, dict) and scaling.get("rope_type") == "longrope":
        factor = scaling.get("attention_factor")
        if not isinstance(factor, float) or not factor > 0:
            raise PymlError(f"{model_dir / 'config.json'}: rope_scaling's attention_factor must be a "
                            f"positive number, not {factor!r}")
        metadata["phi3.rope.scaling.attn_factor"] = float(np.float32(factor))
    return metadata


def general_metadata(model_dir: Path, fine_tune: bool = False) -> dict[str, object]:
    """The `general.*` metadata about the model: its source GGUF's (the folder's
    gguf_general.json, which a checkpoint copies from its --init folder), as it was when the
    folder holds that GGUF's weights (source.gguf beside them) and is no `fine_tune`, else as a
    fine-tune of it (see the module docstring). A folder without that file is named after itself."""
    path = model_dir / GENERAL_FILE
    source = _read_json(path) if path.is_file() else {}
    source = {key: value for key, value in source.items() if not key.startswith(NOT_CARRIED)}
    name = source.get("general.name")
    if not isinstance(name, str):
        return source | {"general.name": model_dir.resolve().name}
    if (model_dir / SOURCE_GGUF).is_file() and not fine_tune:
        return source
    release = {field: source.pop(f"general.{field}") for field in BASE_MODEL_FIELDS
               if f"general.{field}" in source}
    kept = {key: value for key, value in source.items()
            if not key.startswith(NOT_CARRIED_BY_A_FINE_TUNE)}
    return kept | {"general.name": name + FINE_TUNE_SUFFIX, "general.base_model.count": 1} | {
        f"general.base_model.0.{field}": value for field, value in release.items()}


def rope_factor_tensors(model_dir: Path, config: dict) -> dict[str, GGUFTensor]:
    """The tensors the importer reads config.json's RoPE scaling from, as llama.cpp's converter
    computes them: rope_freqs.weight for Llama 3's, rope_factors_short and rope_factors_long for
    LongRoPE's (none for any other)."""
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type") == "longrope":
        return {name: float32_tensor(name, scaling.get(key), model_dir)
                for key, name in LONGROPE_FACTORS.items()}
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        return {}
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if any(not isinstance(scaling.get(key), (int, float)) or isinstance(scaling.get(key), bool)
           or not scaling[key] > 0 for key in keys):
        raise PymlError(f"{model_dir / 'config.json'}: rope_scaling {scaling!r} lacks one of "
                        f"{', '.join(keys)} as a positive number")
    head_dim, theta = config.get("head_dim"), config.get("rope_theta")
    if type(head_dim) is not int or type(theta) is not float:
        raise PymlError(f"{model_dir / 'config.json'}: head_dim and rope_theta must be numbers")
    factors = llama3_rope_factors({key: scaling[key] for key in keys}, head_dim,
                                  float(np.float32(theta)))
    return {ROPE_FACTORS: GGUFTensor(ROPE_FACTORS, GGMLType.F32, factors.shape, factors.view(np.uint8))}


def float32_tensor(name: str, values, model_dir: Path) -> GGUFTensor:
    """A float32 tensor of config.json's list `values` (LongRoPE's factors)."""
    if not isinstance(values, list) or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        raise PymlError(f"{model_dir / 'config.json'}: rope_scaling's factors for {name} must be a "
                        "list of numbers")
    array = np.array(values, np.float32)
    return GGUFTensor(name, GGMLType.F32, array.shape, array.view(np.uint8))


def tokenizer_metadata(model_dir: Path, described: dict, settings: dict) -> dict[str, object]:
    """The `tokenizer.*` metadata of the folder's tokenizer.json (`described`) and
    tokenizer_config.json (`settings`)."""
    path = model_dir / "tokenizer.json"
    model = described.get("model") or {}
    if model.get("type") != "BPE":
        raise PymlError(f"{path}: a {model.get('type')!r} tokenizer; only BPE ones are exported")
    vocab = model.get("vocab") or {}
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[token] for token in tokens] != list(range(len(tokens))):
        raise PymlError(f"{path}: the vocabulary's ids are not 0, 1, 2, ... without gaps")
    kinds = np.full(len(tokens), NORMAL_TOKEN, np.int32)
    for added in described.get("added_tokens", []):
        if not 0 <= added["id"] < len(tokens) or added["content"] != tokens[added["id"]]:
            raise PymlError(f"{path}: added token {added['content']!r} is not token {added['id']}")
        kinds[added["id"]] = CONTROL_TOKEN if added["special"] else USER_DEFINED_TOKEN
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]

    metadata: dict[str, object] = {"tokenizer.ggml.tokens": tokens}
    if model.get("byte_fallback"):  # SentencePiece, as `tokenizer.build_tokenizer` builds it
        bytes_ = [vocab[f"<0x{byte:02X}>"] for byte in range(256) if f"<0x{byte:02X}>" in vocab]
        kinds[bytes_] = BYTE_TOKEN
        unknown = vocab.get(model.get("unk_token"))
        if unknown is not None and kinds[unknown] == NORMAL_TOKEN:  # not also a control token
            kinds[unknown] = UNKNOWN_TOKEN  # llama.cpp refuses a vocabulary whose <unk> is normal
        metadata |= {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.scores": _scores_from_merges(merges, vocab, kinds),
            "tokenizer.ggml.add_space_prefix": _prepends_space(described.get("normalizer")),
        }
    else:
        metadata |= {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": _pre_tokenizer_name(path, described.get("pre_tokenizer")),
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_space_prefix": False,
        }
    metadata["tokenizer.ggml.token_type"] = kinds
    for name, key in SPECIAL_TOKENS.items():
        if isinstance(settings.get(name), str):
            if settings[name] not in vocab:
                raise PymlError(f"{model_dir / 'tokenizer_config.json'}: {name} "
                                f"{settings[name]!r} is not in the vocabulary")  # fmt: skip
            metadata[key] = vocab[settings[name]]
    for flag in ("add_bos_token", "add_eos_token"):
        metadata[f"tokenizer.ggml.{flag}"] = bool(settings.get(flag, False))
    if isinstance(settings.get("chat_template"), str):
        metadata["tokenizer.chat_template"] = settings["chat_template"]
    return metadata


def _scores_from_merges(merges: list[str], vocab: dict[str, int], kinds: np.ndarray) -> np.ndarray:
    """Scores that rank the normal tokens as the merges do (see the module docstring); the normal
    tokens no merge makes (single characters) come after them all, in id order."""
    scores = np.zeros(len(vocab), np.float32)
    scores[(kinds == CONTROL_TOKEN) | (kinds == USER_DEFINED_TOKEN)] = ADDED_TOKEN_SCORE
    ranked: dict[int, None] = {}
    for merge in merges:
        made = vocab.get(merge.replace(" ", "", 1))
        if made is not None and kinds[made] == NORMAL_TOKEN:
            ranked.setdefault(made)
    unranked = [index for index in np.flatnonzero(kinds == NORMAL_TOKEN) if index not in ranked]
    order = [*ranked, *unranked]
    scores[order] = -np.arange(len(order), dtype=np.float32)
    return scores


def _prepends_space(normalizer: dict | None) -> bool:
    """Whether the normalizer puts "▁" in front of each stretch of text (a Prepend, alone or in
    a Sequence)."""
    steps = (normalizer or {}).get("normalizers") or [normalizer or {}]
    return any(step.get("type") == "Prepend" for step in steps)


def _pre_tokenizer_name(path: Path, pre_tokenizer: dict | None) -> str:
    """llama.cpp's name for the byte-level pre-tokenizer tokenizer.json uses."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from pyml.formats.tokenizer import _PRE_TOKENIZERS

    for name, candidate in _PRE_TOKENIZERS.items():
        probe = Tokenizer(BPE())
        probe.pre_tokenizer = candidate
        if json.loads(probe.to_str())["pre_tokenizer"] == pre_tokenizer:
            return name
    raise PymlError(f"{path}: its pre-tokenizer is none that llama.cpp names ({_PRE_TOKENIZERS})")


# -- the checks


def _check_reads_back(
    model_dir: Path,
    described: GGUFFile,
    architecture: Llama,
    config: dict,
    tokenizer: dict,
    settings: dict,
) -> None:
    """The metadata must read back, as the importer reads a file, as the folder's own files."""
    tied = config.get("tie_word_embeddings") is True
    ids = {
        f"{name}_token_id": special_token_id(described, f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    ids = {name: index for name, index in ids.items() if index is not None}
    for key, expected in (architecture.hf_config(tied) | ids).items():
        if config.get(key) != expected:
            raise PymlError(
                f"{model_dir / 'config.json'}: {key} is {config.get(key)!r}; a {architecture.name} "
                f"GGUF says {expected!r} (llama.cpp cannot run this model as it is)"
            )
    generation = _read_json(model_dir / "generation_config.json")
    if generation != ids:
        raise PymlError(
            f"{model_dir / 'generation_config.json'}: {generation} differs from tokenizer_config"
            f".json's special tokens {ids}"
        )
    if tokenizer_config(described) != settings:
        raise PymlError(
            f"{model_dir / 'tokenizer_config.json'}: holds settings a GGUF cannot (only the special"
            " tokens, add_bos_token, add_eos_token and chat_template)"
        )
    template = model_dir / "chat_template.jinja"
    if template.is_file() and template.read_text(encoding="utf-8") != settings.get("chat_template"):
        raise PymlError(f"{template}: differs from tokenizer_config.json's chat_template")
    rebuilt = json.loads(build_tokenizer(described).to_str())
    if rebuilt != tokenizer:
        raise PymlError(
            f"{model_dir / 'tokenizer.json'}: describes a tokenizer GGUF metadata cannot hold "
            "(it reads back as another); only tokenizers `pyml import-gguf` writes are exported"
        )


def _tensor_plan(
    path: Path,
    tensors: dict[str, StoredTensor],
    architecture: Llama,
    config: dict,
    matrix_type: GGMLType,
) -> list[tuple[str, str, tuple[int, ...], GGMLType]]:
    """(GGUF name, Hugging Face name, shape, type) of every tensor, checked against the tensors
    the folder stores (in the file at `path`); the tensors that follow from the config
    (`derived_tensors`) come last, with no Hugging Face name."""
    tied = config.get("tie_word_embeddings") is True
    expected = architecture.expected_shapes(tied)
    derived = architecture.derived_tensors()
    hf_names = {architecture.hf_name(name): name for name in expected if name not in derived}
    found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    missing = [name for name in hf_names if name not in found]
    if missing:
        raise PymlError(f"{path}: lacks {_first_few(missing)}, which config.json's model has")
    unexpected = [name for name in found if name not in hf_names]
    if unexpected:
        raise PymlError(
            f"{path}: holds {_first_few(unexpected)}, which config.json's model does not have"
        )
    plan = []
    for hf_name, name in hf_names.items():
        if found[hf_name] != expected[name]:
            raise PymlError(
                f"{path}: tensor {hf_name} has shape {found[hf_name]}; config.json's model has "
                f"{expected[name]} ({architecture.describe_dims()})"
            )
        if matrix_type is None:
            kind = stored_type(tensors[hf_name].ggml_type, expected[name])
        else:
            kind = tensor_type(name, expected[name], matrix_type, architecture.dims.n_layers, tied)
        plan.append((name, hf_name, expected[name], kind))
    return plan + [(name, None, tensor.shape, GGMLType.F32) for name, tensor in derived.items()]


def stored_type(kind: GGMLType, shape: tuple[int, ...]) -> GGMLType:
    """The type "as-stored" writes a tensor stored as `kind` in: that type where pyml encodes it,
    else F32 (BF16, F64 and the K types without a quantizer here: Q2_K, Q3_K); 1-D ones F32."""
    return kind if len(shape) == 2 and kind in ENCODABLE else GGMLType.F32


class ComputedTensor:
    """A tensor whose float32 values a function gives when it is written (a merged LoRA matrix),
    in the type `ggml_type` of the tensor it replaces (for "as-stored")."""

    def __init__(self, ggml_type: GGMLType, values):
        self.ggml_type, self.values = ggml_type, values

    def dense(self, dtype=np.float32) -> np.ndarray:
        return np.asarray(self.values(), dtype)


def fallbacks(plan, architecture: Llama, config: dict, asked: GGMLType) -> dict[str, GGMLType]:
    """The tensors of `plan` stored in another type than the one `asked` gives them
    (`mix_type`), because their rows are no whole number of its blocks: name -> the type stored."""
    if asked is None:  # as stored: nothing was asked of any tensor
        return {}
    tied = config.get("tie_word_embeddings") is True
    return {name: kind for name, hf_name, shape, kind in plan if hf_name is not None
            and kind != mix_type(name, shape, asked, architecture.dims.n_layers, tied)}


def tensor_type(name: str, shape: tuple[int, ...], asked: GGMLType, n_layers: int, tied: bool) -> GGMLType:
    """The type a tensor is stored in when `asked` is: its `mix_type`, unless its rows are no whole
    number of that type's blocks; then the type of 32-value blocks llama-quantize falls back to
    (FALLBACK), or F16."""
    kind, row = mix_type(name, shape, asked, n_layers, tied), shape[-1]
    if row % FORMATS[kind].block_values:
        kind = FALLBACK.get(kind, kind)
    return GGMLType.F16 if row % FORMATS[kind].block_values else kind


def mix_type(name: str, shape: tuple[int, ...], asked: GGMLType, n_layers: int, tied: bool) -> GGMLType:
    """The type `asked` gives a tensor before any fallback: 1-D ones stay float32; with a K-quant
    asked, as llama-quantize chooses (llama-quant.cpp, llama_tensor_get_type): the output matrix
    (the embedding, when the head is tied to it) in Q6_K, or Q8_0 if its rows are no whole
    number of 256-value blocks; in the _M mixes (Q4_K, Q5_K asked) attn_v and ffn_down in Q6_K
    on the layers `use_more_bits` picks."""
    if len(shape) == 1:
        return GGMLType.F32
    kind, row = asked, shape[-1]
    if asked in K_QUANTS:
        _, layer, within = (name.split(".", 2) + ["", ""])[:3]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            kind = GGMLType.Q8_0 if row % FORMATS[asked].block_values else GGMLType.Q6_K
        elif asked != GGMLType.Q6_K and within in ("attn_v.weight", "ffn_down.weight") and (
                use_more_bits(int(layer), n_layers)):
            kind = GGMLType.Q6_K
    return kind


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's layers that get more bits in a mix: the first and last eighth, and every
    third one between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


# -- writing


def gguf_weight(architecture: Llama, gguf_name: str, weight: np.ndarray) -> np.ndarray:
    """The value the GGUF stores for a Hugging Face tensor: the inverse of `hf_weight`."""
    within = gguf_name.split(".", 2)[-1]
    if architecture.name == "llama" and within in ("attn_q.weight", "attn_k.weight"):
        heads = (
            architecture.dims.n_heads if within == "attn_q.weight" else architecture.dims.n_kv_heads
        )
        return permute_rotary_rows(weight, heads)
    if architecture.name == "gemma3" and gguf_name.endswith("norm.weight"):
        return weight + np.float32(1)
    return weight


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's reordering of a Q or K projection's rows, so that it rotates neighbours:
    w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2), the inverse of
    `gguf_architectures.unpermute_rotary_rows`."""
    head_dim = weight.shape[0] // n_heads
    return np.ascontiguousarray(
        weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write(path, architecture, metadata, tensors, plan, file_type, shown_name, raw=frozenset()) -> None:
    """The GGUF at `path`, one tensor encoded at a time (each source tensor is dropped once
    written), with a progress bar naming `shown_name` unless it is empty; the tensors named in
    `raw` (a source GGUF's) written as their stored bytes where their type is kept."""
    writer = gguf.GGUFWriter(path, architecture.name)
    for key, value in metadata.items():
        if key != "general.architecture":  # the writer adds it
            _add(writer, key, value)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, _, shape, kind in plan:
        # the shape in numpy order; with raw_dtype given, the writer takes it as it is
        writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(kind, shape),
                               raw_dtype=gguf.GGMLQuantizationType(int(kind)))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(plan, disable=not shown_name, unit="tensor", desc=f"writing {shown_name}") as bar:
        for name, hf_name, _, kind in bar:
            if hf_name is None:
                writer.write_tensor_data(architecture.derived_tensors()[name])
                continue
            tensor = tensors.pop(hf_name)
            if hf_name in raw and tensor.ggml_type == kind:  # the file's own bytes, GGUF order
                writer.write_tensor_data(tensor.data)
                continue
            weight = tensor.dense(np.float32)
            writer.write_tensor_data(quantize(gguf_weight(architecture, name, weight), kind))
    (handle,) = writer.fout
    handle.flush()
    os.fsync(handle.fileno())
    writer.close()


def _add(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    """One metadata entry, typed as the converter types it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, np.ndarray):
        writer.add_key_value(key, value.tolist(), gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.INT32 if value.dtype.kind == "i"
                             else gguf.GGUFValueType.FLOAT32)  # fmt: skip
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.STRING)  # fmt: skip


# -- reading the folder


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PymlError(
            f"{path}: missing; export a folder written by `pyml import-gguf`, or a checkpoint of a "
            "run started from one"
        ) from None
    except (OSError, ValueError) as error:
        raise PymlError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise PymlError(f"{path}: not a JSON object")
    return value


def _first_few(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
